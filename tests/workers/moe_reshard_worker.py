"""A MoE checkpoint saved under one expert-parallel size, loaded under others (DCP resharding).

Usage: moe_reshard_worker.py OUT save|load EP, or ``run(OUT, MODE, EP, ctx)`` from another worker
already in its process group (moe_parity_worker.py: the parity cases and this in one launch). The
Trainer trains kiln.models.MoELlama (float64,
AdamW, aux loss) on ``WORLD_SIZE`` ranks with ``Hybrid(ep=EP)`` (EP 1 on one rank: ``single``).

* ``save``: 2 batches, then ``trainer.save_checkpoint(OUT/ckpt)`` (sharded: DCP); rank 0 writes
  the full weights and full optimizer state to OUT/saved.pt and the checkpoint's path to OUT/path.
* ``load``: a model from another seed, ``load_path`` = that checkpoint; rank 0 writes to
  OUT/loaded_<world>.json how far the loaded weights and optimizer state are from OUT/saved.pt,
  then trains 1 more batch and writes the full weights to OUT/final_<world>.pt.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import kiln
from kiln.parallel import Hybrid, full_model_state_dict
from kiln.parallel.state.dcp_state import optimizer_state_dict

GLOBAL_BATCH, SEQ, VOCAB = 8, 8, 32


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, VOCAB, (4 * GLOBAL_BATCH, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


def make_model(seed):
    torch.manual_seed(seed)
    model = kiln.models.MoELlama(
        vocab_size=VOCAB, dim=16, num_layers=2, num_heads=4, max_seq_len=SEQ, num_experts=4, top_k=2, moe_hidden_dim=16
    )
    return model.double()


def _plain(state):
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in state.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().cpu().clone()
    return out


def run(out, mode, ep, ctx):
    model = make_model(0 if mode == "save" else 7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = ctx.world_size
    load_path = open(os.path.join(out, "path")).read() if mode == "load" else None
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(Tokens(), batch_size=GLOBAL_BATCH // world),
        max_duration="2ba" if mode == "save" else "3ba",
        optimizers=optimizer,
        strategy="single" if world == 1 else Hybrid(dp_shard=-1, ep=ep),
        load_path=load_path,
        progress_bar=False,
        seed=0,
    )
    if mode == "save":
        trainer.fit()
        path = trainer.save_checkpoint(os.path.join(out, "ckpt"))
        weights = _plain(full_model_state_dict(trainer.engine))
        opt_state = _plain(optimizer_state_dict(trainer.engine.model, optimizer, full=True))
        if ctx.rank == 0:
            torch.save({"weights": weights, "optimizer": opt_state}, os.path.join(out, "saved.pt"))
            with open(os.path.join(out, "path"), "w") as f:
                f.write(path)
    else:
        saved = torch.load(os.path.join(out, "saved.pt"), weights_only=True)
        weights = _plain(full_model_state_dict(trainer.engine))
        opt_state = _plain(optimizer_state_dict(trainer.engine.model, optimizer, full=True))
        report = {"batch": int(trainer.state.timestamp.batch.value)}
        for key, got in (("weights", weights), ("optimizer", opt_state)):
            want = saved[key]
            report[f"{key}_missing"] = sorted(set(want) - set(got))
            report[f"{key}_extra"] = sorted(set(got) - set(want))
            common = [k for k in want if k in got]
            report[f"{key}_abs"] = max((got[k] - want[k]).abs().max().item() for k in common)
            report[f"{key}_count"] = len(common)
        report["expert_keys"] = sorted(k for k in weights if ".experts." in k)
        trainer.fit()
        final = _plain(full_model_state_dict(trainer.engine))
        if ctx.rank == 0:
            with open(os.path.join(out, f"loaded_{world}.json"), "w") as f:
                json.dump(report, f, indent=1)
            torch.save(final, os.path.join(out, f"final_{world}.pt"))
    if dist.is_initialized():
        dist.barrier()


def main():
    out, mode, ep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)
    run(out, mode, ep, ctx)


if __name__ == "__main__":
    main()
