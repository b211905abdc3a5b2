"""The golden runs: small trainings whose per-step losses and final weights must not change by a bit
when the training step is restructured (tests/test_golden_runs.py compares them with
tests/data/golden_runs.json).

    python golden_runs.py OUT single            # the one-process cases (no process group)
    kiln run -n 2 golden_runs.py OUT multi      # the two-rank cases, one after another in one launch

Writes ``OUT/golden_<group>.json``: ``{case: {"losses": [[hex, ...] per rank], "weights_sha256": [hex per rank],
"weights": {name: short sha}, "optimizer_sha256": [hex per rank]}}``. Losses are the per-step
(Trainer: per batch; Engine: per micro-step) values of this rank, as ``float.hex``. The weights hash
covers the full, unwrapped model (``kiln.parallel.full_model_state_dict``) in sorted key order:
name, dtype, shape and the raw bytes of each tensor. The optimizer hash covers every tensor of the
full optimizer state (and each group's lr) in sorted key order, as each rank's strategy returns it.

Everything the runs depend on (models, data, hyper-parameters, configs) is defined here, not borrowed
from other tests or examples, so that editing those cannot move the recording.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import kiln

torch.set_num_threads(1)  # the recording is bit-exact only for a fixed reduction order inside kernels

TP_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


# -- models and data ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    """3 residual blocks: a tensor-parallel plan for the blocks, a pipeline split at ``blocks.1``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class DropoutNet(nn.Sequential):
    """Dropout, so a resume must restore the RNG too."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.25), nn.Linear(16, 4))


class TokenDataset(torch.utils.data.Dataset):
    """nnScaler-style token batches: sample i has ``1 + (i * 3) % length`` real tokens."""

    def __init__(self, size: int = 16, length: int = 5, dim: int = 3) -> None:
        g = torch.Generator().manual_seed(11)
        self.x, self.y = torch.randn(size, length, dim, generator=g), torch.randn(size, length, generator=g)
        counts = torch.tensor([1 + (i * 3) % length for i in range(size)])
        self.mask = (torch.arange(length)[None, :] < counts[:, None]).float()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "mask": self.mask[i]}


class TokenModel(nn.Module):
    """End to end: ``forward(batch)`` -> (sum of squared errors over real tokens, number of real tokens)."""

    def __init__(self, dim: int = 3, hidden: int = 8) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, 1)

    def forward(self, batch: dict[str, torch.Tensor]):
        err = (self.fc2(torch.tanh(self.fc1(batch["x"]))).squeeze(-1) - batch["y"]) ** 2
        return (err * batch["mask"]).sum(), batch["mask"].sum()


def count_tokens(loss_outputs: list[Any], sync_group: Any) -> Any:
    """``aggregate_outputs_fn`` for per-token-mean: loss sum, micro-batch and token counts of all ranks."""
    from kiln.config.reduction import AggregatedOutputs

    return AggregatedOutputs.aggregate(loss_outputs, sync_group, ntokens_fn=lambda output: output[1])


def dataset(n: int = 64, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g))


def loader(batch_size: int = 8, shuffle: bool = True, **kwargs: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset(), batch_size=batch_size, shuffle=shuffle, **kwargs)


def make(model_cls: type = Net, sgd: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer. Adam is nearly blind to a gradient's scale (a clipping factor, a
    sum instead of a mean), so the cases that test scaling use SGD with momentum."""
    torch.manual_seed(0)
    model = model_cls()
    if sgd:
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


# -- what is recorded --------------------------------------------------------------------------
def _hex(value: Any) -> str:
    return float(value.detach().cpu() if isinstance(value, torch.Tensor) else value).hex()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    # through uint8 so that every dtype (bf16 too) gives its raw bytes
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _weights(engine: Any) -> dict[str, torch.Tensor]:
    pipeline = getattr(engine.strategy, "pipeline", None)
    if pipeline is not None:
        from kiln.parallel import full_pipeline_state_dict

        return full_pipeline_state_dict(engine.model)
    return kiln.parallel.full_model_state_dict(engine)


def weights_digest(engine: Any) -> tuple[str, dict[str, str]]:
    total, each = hashlib.sha256(), {}
    state = _weights(engine)
    for name in sorted(state):
        t = state[name]
        h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode() + _tensor_bytes(t)).hexdigest()
        each[name] = h[:16]
        total.update(h.encode())
    return total.hexdigest(), each


def _leaves(obj: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _leaves(obj[key], f"{path}.{key}" if path else str(key), out)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            _leaves(item, f"{path}.{i}", out)
    else:
        out.append((path, obj))


def optimizer_digest(engine: Any) -> str:
    """Every tensor and number of this rank's full optimizer state (DCP's flattened form,
    ``state.<param>.<key>``) and each group's lr; the other entries of the param groups (flags such
    as ``foreach``) say nothing about the numbers and are left out."""
    from torch.distributed.tensor import DTensor

    state = engine.strategy.state_dict(engine.model, engine.optimizer, full=True)["optimizer"]
    leaves: list[tuple[str, Any]] = []
    _leaves(state, "", leaves)
    h = hashlib.sha256()
    for path, value in leaves:
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            data = f"{value.dtype}|{tuple(value.shape)}|".encode() + _tensor_bytes(value)
        elif (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (path.startswith("state") or path.endswith(".lr"))
        ):
            data = _hex(value).encode()
        else:
            continue
        h.update(path.encode() + b"=" + hashlib.sha256(data).digest())
    return h.hexdigest()


class RecordLoss(kiln.Callback):
    """``state.loss`` at each ``BATCH_END`` (the batch's loss on this rank, after every reduction)."""

    def __init__(self) -> None:
        self.losses: list[str] = []

    def batch_end(self, state: Any, logger: Any) -> None:
        self.losses.append(_hex(state.loss))


# -- the cases ---------------------------------------------------------------------------------
def trainer_case(
    strategy: Any = "auto",
    *,
    grad_accum: int = 1,
    clip: float | None = None,
    algorithms=(),
    precision: str | None = None,
    batches: int = 4,
    sgd: bool = False,
    scheduler: bool = True,
    **kwargs: Any,
):
    def run(tmp: str):
        model, opt = make(sgd=sgd)
        record = RecordLoss()
        trainer = kiln.Trainer(
            model,
            train_dataloader=loader(drop_last=True),
            max_duration=f"{batches}ba",
            optimizers=opt,
            # per batch, from the full rate
            schedulers=kiln.optim.CosineAnnealingScheduler(alpha_f=0.2) if scheduler else None,
            criterion=nn.CrossEntropyLoss(),
            strategy=strategy() if callable(strategy) else strategy,
            grad_accum=grad_accum,
            clip_grad_norm=clip,
            precision=precision,
            algorithms=list(algorithms),
            callbacks=[record],
            seed=0,
            progress_bar=False,
            **kwargs,
        )
        trainer.fit()
        return record.losses, trainer.engine

    return run


def engine_case(config: dict[str, Any], micro_steps: int = 8, sgd: bool = False):
    """Colossal-AI's four-line loop on ``kiln.initialize``; one loss per micro-step."""

    def run(tmp: str):
        model, opt = make(sgd=sgd)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        engine, train_dl, _, sched = kiln.initialize(
            model, opt, nn.CrossEntropyLoss(), loader(batch_size=4), lr_scheduler=sched, config=config
        )
        if hasattr(train_dl.sampler, "set_epoch"):
            train_dl.sampler.set_epoch(0)
        losses: list[str] = []
        engine.train()
        for step, (x, y) in enumerate(train_dl):
            if step == micro_steps:
                break
            engine.zero_grad()
            loss = engine.criterion(engine(x), y)
            engine.backward(loss)
            engine.step()
            sched.step()
            losses.append(_hex(loss))
        return losses, engine

    return run


def config_case(overrides: list[str], **config: Any):
    """nnScaler's config path: TrainerArgs from a dict plus command-line overrides -> build_trainer."""

    def run(tmp: str):
        from kiln.config import build_trainer, load_trainer_args

        base = {
            "model": {"type": "golden_runs.TokenModel"},
            "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.01, "momentum": 0.9}},
            "dataset": {"type": "golden_runs.TokenDataset", "train_args": {"size": 16}},
            "dataset_sampler": {"train_args": {"shuffle": True}},
            "checkpoint": {"no_save": True},
            "max_train_steps": 4,
            "seed": 0,
            "enable_progress_bar": False,
            **config,
        }
        args = load_trainer_args(base, overrides, world_size=kiln.context().world_size)
        record = RecordLoss()
        trainer = build_trainer(args, callbacks=[record])
        trainer.fit()
        return record.losses, trainer.engine

    return run


class _Crash(Exception):
    pass


class _CrashAfter(kiln.Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state: Any, logger: Any) -> None:
        if state.timestamp.batch.value == self.batch:
            raise _Crash()  # before this batch's checkpoint event: as if the process had died here


def resume_mid_epoch(strategy: str, resumes_at: int):
    """A Trainer (dropout, shuffling, AdamW, warmup + cosine, grad_accum=2) that checkpoints after the
    2nd batch of every epoch (mid-epoch) and at each epoch's end, crashes at the end of batch 7 and
    is autoresumed from the last checkpoint (batch ``resumes_at``, mid-epoch) to batch 12. The
    losses are those of both launches in order (batches 1-7, then resumes_at+1 to 12)."""

    def save_when(state: Any, event: Any) -> bool:
        return event == kiln.Event.EPOCH_CHECKPOINT or state.timestamp.batch_in_epoch.value == 2

    def build(folder: str, autoresume: bool, callbacks: list[Any]):
        model, opt = make(DropoutNet)
        return kiln.Trainer(
            model,
            train_dataloader=loader(drop_last=True),
            max_duration="12ba",
            optimizers=opt,
            schedulers=kiln.optim.CosineAnnealingWithWarmupScheduler(t_warmup="3ba"),
            criterion=nn.CrossEntropyLoss(),
            strategy=strategy,
            grad_accum=2,
            seed=0,
            progress_bar=False,
            callbacks=callbacks,
            save_folder=folder,
            save_interval=save_when,
            autoresume=autoresume,
        )

    def run(tmp: str):
        folder = os.path.join(tmp, "ckpt")
        first, second = RecordLoss(), RecordLoss()
        try:
            build(folder, False, [first, _CrashAfter(7)]).fit()
            raise RuntimeError("the first launch was meant to crash after batch 7")
        except _Crash:
            pass
        trainer = build(folder, True, [second])
        resumed_from = trainer.state.timestamp.batch.value
        if resumed_from != resumes_at:
            raise RuntimeError(f"resumed from batch {resumed_from}, expected {resumes_at} (a mid-epoch checkpoint)")
        trainer.fit()
        return first.losses + second.losses, trainer.engine

    return run


def _deepspeed_config() -> dict[str, Any]:
    return {"zero_optimization": {"stage": 2}, "steps_per_print": 10**9}


SINGLE: dict[str, Callable[[str], Any]] = {
    "trainer_single": trainer_case("single"),
    "trainer_single_accum2_clip": trainer_case("single", grad_accum=2, clip=0.05, sgd=True),
    "trainer_single_amp_bf16": trainer_case("single", precision="amp_bf16"),
    "trainer_single_sam": trainer_case("single", algorithms=[kiln.algorithms.SAM(rho=0.05)], grad_accum=2),
    "trainer_single_gradclip_adaptive": trainer_case(
        "single", algorithms=[kiln.algorithms.GradientClipping("adaptive", 0.05)], sgd=True
    ),
    "trainer_single_gradclip_value": trainer_case(
        "single", algorithms=[kiln.algorithms.GradientClipping("value", 0.01)], grad_accum=2, sgd=True
    ),
    "engine_single_accum2_clip": engine_case({"gradient_accumulation": 2, "clip_grad_norm": 0.05}, sgd=True),
    "config_sum_accum2": config_case(
        ["--optimizer.grad_reduction", "sum", "--optimizer.loss_reduction", "sum"],
        micro_batch_size=2,
        global_batch_size=4,
    ),
    "config_per_token_mean_accum2_clip": config_case(
        ["--optimizer.grad_reduction", "per-token-mean", "--optimizer.clip_gnorm", "0.5"],
        micro_batch_size=2,
        global_batch_size=4,
        optimizer={
            "type": "torch.optim.SGD",
            "args": {"lr": 0.01, "momentum": 0.9},
            "aggregate_outputs_fn": "golden_runs.count_tokens",
        },
    ),
    "resume_single_mid_epoch": resume_mid_epoch("single", 2),  # 8 batches per epoch
}

MULTI: dict[str, Callable[[str], Any]] = {
    "trainer_ddp_accum2_clip": trainer_case("ddp", grad_accum=2, clip=0.05, sgd=True),
    "trainer_zero1_accum2": trainer_case("zero1", grad_accum=2),
    "trainer_zero2_clip": trainer_case("zero2", clip=0.05, sgd=True),
    "trainer_zero3_accum2_clip": trainer_case("zero3", grad_accum=2, clip=0.05, sgd=True),
    "trainer_tp_clip": trainer_case(lambda: kiln.parallel.TensorParallel(TP_PLAN), clip=0.05, sgd=True),
    "trainer_pp_1f1b": trainer_case(
        lambda: kiln.parallel.Pipeline(["blocks.1"], schedule="1f1b", microbatches=2), clip=0.05, sgd=True
    ),
    "trainer_hybrid_tp": trainer_case(lambda: kiln.parallel.Hybrid(dp_shard=1, tp=2, tp_plan=TP_PLAN), grad_accum=2),
    "trainer_ddp_sam": trainer_case("ddp", algorithms=[kiln.algorithms.SAM(rho=0.05)]),
    "trainer_ddp_gradclip_norm": trainer_case(
        "ddp", algorithms=[kiln.algorithms.GradientClipping("norm", 0.05)], grad_accum=2, sgd=True
    ),
    "engine_ddp_accum2_clip": engine_case(
        {"gradient_accumulation": 2, "clip_grad_norm": 0.05, "strategy": "ddp"}, sgd=True
    ),
    "engine_zero3_accum2": engine_case({"gradient_accumulation": 2, "strategy": "zero3"}),
    "config_zero1_sum_accum2": config_case(
        ["--compute_config.use_zero", "true", "--optimizer.grad_reduction", "sum"],
        micro_batch_size=1,
        global_batch_size=4,
    ),
    "config_ddp_per_token_mean": config_case(
        ["--compute_config.strategy", "ddp", "--optimizer.grad_reduction", "per-token-mean"],
        micro_batch_size=2,
        global_batch_size=4,
        optimizer={
            "type": "torch.optim.SGD",
            "args": {"lr": 0.01, "momentum": 0.9},
            "aggregate_outputs_fn": "golden_runs.count_tokens",
        },
    ),
    "resume_ddp_mid_epoch": resume_mid_epoch("ddp", 6),  # 4 batches per epoch on each rank
    # No scheduler: a kiln.optim scheduler on DeepSpeed's ZeRO optimizer (stage >= 1) raises TypeError
    # ("DeepSpeedZeroOptimizer is not an Optimizer") in the Trainer as of this recording. AdamW: DeepSpeed
    # refuses other optimizers under ZeRO unless told to.
    "deepspeed_zero2_accum2_clip": trainer_case(
        "deepspeed", grad_accum=2, clip=0.05, scheduler=False, deepspeed_config=_deepspeed_config()
    ),
}


def deepspeed_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def main() -> None:
    out, group = sys.argv[1], sys.argv[2]
    only = set(sys.argv[3:])
    cases = {"single": SINGLE, "multi": MULTI}[group]
    distributed = "RANK" in os.environ
    if distributed:
        kiln.launch_from_torch()
    rank = kiln.context().rank
    results: dict[str, Any] = {}
    for name, run in cases.items():
        if only and name not in only:
            continue
        if name.startswith("deepspeed") and not deepspeed_available():
            continue
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            if distributed:  # every rank writes into the same checkpoint folder: rank 0's
                box = [tmp]
                torch.distributed.broadcast_object_list(box, src=0)
                tmp = box[0]
            losses, engine = run(tmp)
            total, each = weights_digest(engine)
            entry = {
                "losses": [losses],
                "weights_sha256": [total],
                "weights": each,
                "optimizer_sha256": [optimizer_digest(engine)],
            }
            if distributed:
                for key in ("losses", "weights_sha256", "optimizer_sha256"):
                    gathered: list[Any] = [None] * torch.distributed.get_world_size()
                    torch.distributed.all_gather_object(gathered, entry[key][0])
                    entry[key] = gathered
                torch.distributed.barrier()  # rank 0's folder stays until every rank is done with it
        entry["seconds"] = round(time.perf_counter() - start, 2)
        results[name] = entry
        print(f"[golden] rank {rank} {name}: {entry['seconds']} s", flush=True)
    if rank == 0:
        with open(os.path.join(out, f"golden_{group}.json"), "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    if distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
