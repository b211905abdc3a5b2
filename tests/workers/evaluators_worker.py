"""Two named evaluation sets at different intervals on two ranks under zero3 (each forward a
collective), on eval sets that split unevenly over the ranks.

Usage: evaluators_worker.py OUT with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. Each rank writes
OUT/rank<r>.json: {"val_steps"/"test_steps": the steps each set was logged at, "final": trainer.eval()
after fit, "ref": one process's numbers for the same weights, "forwards": root-module forward calls}.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from kiln.loggers import LoggerDestination
from kiln.metrics import Accuracy
from kiln.parallel import full_model_state_dict
from parallel_model import DTYPE, make_model


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=DTYPE)
    return TensorDataset(x, torch.randint(0, 4, (n,), generator=g))


class Steps(LoggerDestination):
    def __init__(self):
        super().__init__(rank_zero_only=False)  # every rank records what it logged
        self.steps = {}

    def log_metrics(self, metrics, step=None):
        for key in metrics:
            if key.startswith("eval/"):
                self.steps.setdefault(key.split("/")[1], []).append(step)
                break


class EvalBatches(kiln.Callback):
    """The real batches each evaluation ran on this rank: [(label, batches), ...]."""

    def __init__(self):
        self.runs = []

    def eval_start(self, state, logger):
        self.runs.append([{9: "val", 5: "test"}[len(state.eval_dataloader.dataset)], 0])

    def eval_batch_end(self, state, logger):
        self.runs[-1][1] += 1


def reference(state_dict, dataset):
    model = make_model(0)
    model.load_state_dict(state_dict)
    x, y = dataset.tensors
    with torch.no_grad():
        logits = model.eval()(x)
    acc = Accuracy(sync_on_compute=False)
    acc.update(logits, y)
    return F.cross_entropy(logits, y).item(), acc.compute().item()


def main():
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    kiln.launch(
        rank=rank,
        world_size=int(os.environ["WORLD_SIZE"]),
        host=os.environ["MASTER_ADDR"],
        port=os.environ["MASTER_PORT"],
        timeout=timedelta(seconds=float(os.environ.get("KILN_TEST_PG_TIMEOUT", "60"))),
    )
    model = make_model(0)
    forwards = []
    model.register_forward_hook(lambda module, *_: forwards.append(module.training))
    val, test = data(9, 1), data(5, 2)
    steps, batches = Steps(), EvalBatches()
    trainer = kiln.Trainer(
        model,
        train_dataloader=DataLoader(data(24, 0), batch_size=4),  # 3 batches per rank per epoch
        eval_dataloader=[
            kiln.Evaluator("val", DataLoader(val, batch_size=4), interval="2ba"),
            kiln.Evaluator("test", DataLoader(test, batch_size=4), metrics={"acc": Accuracy()}),
        ],
        eval_metrics={"Accuracy": Accuracy()},
        criterion=nn.CrossEntropyLoss(),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="2ep",
        strategy="zero3",
        loggers=[steps],
        callbacks=[batches],
        progress_bar=False,
    )
    trainer.fit()
    logged = {label: list(at) for label, at in steps.steps.items()}
    final = trainer.eval()
    weights = full_model_state_dict(trainer.state.model)
    val_loss, val_acc = reference(weights, val)
    test_loss, test_acc = reference(weights, test)
    result = {
        "val_steps": logged.get("val", []),
        "test_steps": logged.get("test", []),
        "final": final,
        "ref": {
            "eval/val/loss": val_loss,
            "eval/val/Accuracy": val_acc,
            "eval/test/loss": test_loss,
            "eval/test/acc": test_acc,
        },
        "forwards": sum(1 for training in forwards if not training),
        "eval_batches": batches.runs,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    trainer.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
