"""The workloads of ``make gpu-check`` (benchmarks/gpu_check.py) that are kiln code rather than
pytest or lm.py, each run in a process of its own on CUDA when it is there, else on the CPU:

    python benchmarks/gpu_check_parts.py PART FILES [--quick]     # writes FILES/result.json

``result.json`` holds ``status`` (pass or fail), a one-line ``summary`` and ``details``. Each part
compares against a reference run within a bound stated below, and says why the bound is what it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

# Each step's loss against the fp32 run's, relative (the same bounds as tests/test_cuda_paths.py
# for the same MLP): autocast keeps fp32 weights and accumulates in fp32 (the CPU gives 1e-4 over
# 30 steps); bf16 stores weights and the loss in bf16, whose spacing at 1.0 is 2**-7.
PRECISION_BOUNDS = {"amp_fp16": 1e-3, "amp_bf16": 5e-3, "bf16": 4 * 2**-7}
# The FSDP2 and FP8 runs train the blocks for 2 epochs, and their loss falls from ~2.8 to ~0.02,
# where a step's loss relative to itself is noise (the first H200 run read 4e-2 relative at a loss
# of 0.05 for a 2e-3 difference): each step's difference is taken relative to the reference's first
# loss, the task's scale (_worst_vs_start).
FSDP_BF16_BOUND = 2e-2  # FSDP2's bf16 parameters in the whole forward, against fp32
COMPILE_BOUND = 1e-4  # inductor reorders float sums; fp32 otherwise
FP8_BOUND = 5e-2  # e4m3 keeps 3 mantissa bits: the loss moves by a percent or two, not more


# -- the parts' workloads ---------------------------------------------------------------------------
def _mlp_data(n: int = 96, dim: int = 16, classes: int = 4, seed: int = 0) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :classes].argmax(1))


def _mlp() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _blocks(dim: int, depth: int) -> Any:
    """Residual MLP blocks in a ModuleList (kiln's levers find them), dims multiples of 16 (FP8)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Block() for _ in range(depth))
            self.lm_head = nn.Linear(dim, 16)  # the vocabulary projection: FP8 leaves it alone

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(x)

    torch.manual_seed(0)
    return Blocks()


def _blocks_data(dim: int, n: int, seed: int = 0) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :16].argmax(1))


def _trainer_losses(
    model: Any, data: Any, batch_size: int, epochs: int, lr: float = 1e-3, **kwargs: Any
) -> tuple[list[float], Any]:
    """Each batch's loss of a Trainer run (no shuffling: every run sees the same batches)."""
    import torch

    import kiln

    losses: list[float] = []

    class Losses(kiln.Callback):
        def batch_end(self, state: Any, logger: Any) -> None:
            losses.append(float(state.loss.detach()))

    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=batch_size),
        max_duration=f"{epochs}ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=lr),
        criterion=torch.nn.CrossEntropyLoss(),
        callbacks=[Losses()],
        progress_bar=False,
        **kwargs,
    )
    trainer.fit()
    trainer.close()
    return losses, trainer


def _worst(losses: list[float], reference: list[float]) -> float:
    if len(losses) != len(reference) or not all(map(math.isfinite, losses)):
        return math.inf
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def _worst_vs_start(losses: list[float], reference: list[float]) -> float:
    """The largest step difference relative to the reference's first loss (see FSDP_BF16_BOUND)."""
    if len(losses) != len(reference) or not reference or not all(map(math.isfinite, losses)):
        return math.inf
    return max(abs(a - b) for a, b in zip(losses, reference)) / abs(reference[0])


def part_precision(device: Any, quick: bool) -> tuple[str, str, dict[str, Any]]:
    import torch

    import kiln

    steps = 10 if quick else 30

    def engine_losses(precision: str) -> tuple[list[float], Any]:
        model = _mlp().to(device)
        engine = kiln.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.nn.CrossEntropyLoss(),
                             precision=precision, clip_grad_norm=1.0)  # fmt: skip
        x, y = (t.to(device) for t in _mlp_data().tensors)
        losses = []
        for _ in range(steps):
            engine.zero_grad()
            loss = engine.criterion(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses, engine

    def trainer_losses(precision: str) -> list[float]:
        return _trainer_losses(_mlp(), _mlp_data(), 16, steps // 6 + 1, precision=precision, device=device.type)[0]

    engine_ref, trainer_ref = engine_losses("fp32")[0], trainer_losses("fp32")
    details: dict[str, Any] = {}
    texts, ok = [], True
    for precision, bound in PRECISION_BOUNDS.items():
        losses, engine = engine_losses(precision)
        worst = (_worst(losses, engine_ref), _worst(trainer_losses(precision), trainer_ref))
        scaler = getattr(engine, "scaler", None)
        details[precision] = {"engine": worst[0], "trainer": worst[1], "bound": bound}
        good = max(worst) <= bound
        if precision == "amp_fp16":  # GradScaler or nothing: fp16 gradients underflow without one
            good = good and isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() > 0
            details[precision]["grad_scale"] = scaler.get_scale() if scaler is not None else None
        ok = ok and good
        texts.append(f"{precision} {worst[0]:.1e}/{worst[1]:.1e} (<= {bound:.0e})" + ("" if good else " FAIL"))
    summary = f"largest relative loss difference from fp32 in {steps} steps, Engine/Trainer: " + ", ".join(texts)
    return ("pass" if ok else "fail"), summary, details


def _one_rank_group(device: Any) -> None:
    import torch
    import torch.distributed as dist

    from kiln.launch.context import _set_context

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if cuda else None)  # fmt: skip
    _set_context(None)  # kiln.context() describes this group


def part_fsdp2_bf16(device: Any, quick: bool) -> tuple[str, str, dict[str, Any]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from kiln.parallel.transforms.data_parallel import apply_fsdp
    from kiln.parallel.transforms.parallelize import find_blocks
    from kiln.precision import get_precision

    # kiln's zero3 on a world of 1 shards nothing (no mesh: only hooks), and one GPU takes one
    # NCCL rank: so kiln's FSDP2 step itself (per block, then the root, with the policy kiln picks
    # for amp_bf16) on a one-rank mesh, the model then trained by the Trainer
    _one_rank_group(device)
    dim, depth, n = (64, 2, 64) if quick or device.type == "cpu" else (512, 4, 512)
    data = _blocks_data(dim, n)
    reference, _ = _trainer_losses(_blocks(dim, depth), data, 16, 2, device=device.type)
    model = _blocks(dim, depth).to(device)
    apply_fsdp(model, init_device_mesh(device.type, (1,)), get_precision("amp_bf16"), wrap=find_blocks(model))
    seen: list[torch.dtype] = []
    model.layers[0].up.register_forward_pre_hook(lambda module, _: seen.append(module.weight.dtype))
    losses, _ = _trainer_losses(model, data, 16, 2, device=device.type, precision="amp_bf16")
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = sorted({str(m._get_fsdp_state()._mp_policy) for m in sharded})
    worst = _worst_vs_start(losses, reference)
    ok = len(sharded) == depth + 1 and set(seen) == {torch.bfloat16} and worst <= FSDP_BF16_BOUND
    summary = (f"{len(sharded)} fully_shard modules ({policies[0] if len(policies) == 1 else policies}); the forward "
               f"saw {sorted(str(d).removeprefix('torch.') for d in set(seen))} weights; loss vs fp32 {worst:.1e} of the first "
               f"(<= {FSDP_BF16_BOUND:.0e}), last {losses[-1]:.3f} vs {reference[-1]:.3f}")  # fmt: skip
    return ("pass" if ok else "fail"), summary, {"policies": policies, "worst": worst, "losses": losses,
                                                 "reference": reference}  # fmt: skip


def part_compile_ckpt(device: Any, quick: bool) -> tuple[str, str, dict[str, Any]]:
    import torch

    from kiln.parallel.transforms.levers import applied_levers

    dim, depth, n = (64, 2, 64) if quick or device.type == "cpu" else (512, 4, 512)
    data = _blocks_data(dim, n)
    start = time.perf_counter()
    eager, _ = _trainer_losses(_blocks(dim, depth), data, 32, 2, device=device.type)
    eager_s, start = time.perf_counter() - start, time.perf_counter()
    losses, trainer = _trainer_losses(
        _blocks(dim, depth), data, 32, 2, device=device.type, compile=True, activation_checkpointing="full"
    )
    levers = applied_levers(trainer.state.model.layers[0])
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    worst = _worst(losses, eager)
    ok = {"compile", "activation_checkpointing"} <= set(levers) and graphs > 0 and worst <= COMPILE_BOUND
    summary = (f"levers on each block {levers}, {graphs} graphs compiled; loss vs eager {worst:.1e} "
               f"(<= {COMPILE_BOUND:.0e}); {time.perf_counter() - start:.1f} s (eager {eager_s:.1f} s)")  # fmt: skip
    return ("pass" if ok else "fail"), summary, {"levers": levers, "graphs": graphs, "worst": worst}


def part_fp8(device: Any, quick: bool) -> tuple[str, str, dict[str, Any]]:
    import torch

    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    dim, depth, n = (64, 2, 64) if quick or capability is None else (1024, 4, 1024)
    data = _blocks_data(dim, n)
    if capability is None or capability < (8, 9):
        try:
            _trainer_losses(_blocks(dim, depth), data, 32, 1, device=device.type, float8=True)
        except ValueError as exc:
            good = "float8 training needs" in str(exc)
            where = "a CPU" if capability is None else f"compute capability {capability[0]}.{capability[1]}"
            return ("pass" if good else "fail"), f"refused on {where}: {exc}", {"refusal": str(exc)}
        return "fail", "float8=True was accepted on a device without FP8 tensor cores", {}
    from torchao.float8.float8_linear import Float8Linear

    # lr 1e-4: at 1e-3 the 1024-wide blocks' loss climbs from 2.9 to 9.6 and spikes again in the
    # second epoch, and two runs that differ in rounding alone part there (the first H200 run:
    # 0.18 of the first loss apart; float8 emulated on a CPU: 0.11). At 1e-4 the emulation stays
    # within 0.005 of amp_bf16.
    reference, _ = _trainer_losses(_blocks(dim, depth), data, 64, 2, 1e-4, device=device.type, precision="amp_bf16")
    losses, trainer = _trainer_losses(
        _blocks(dim, depth), data, 64, 2, 1e-4, device=device.type, precision="amp_bf16", float8=True
    )
    converted = sum(isinstance(m, Float8Linear) for m in trainer.state.model.modules())
    worst = _worst_vs_start(losses, reference)
    ok = converted == 2 * depth and worst <= FP8_BOUND  # up and down of each block; the head stays
    summary = (f"{converted} Float8Linear layers; loss vs amp_bf16 {worst:.1e} of the first (<= {FP8_BOUND:.0e}), "
               f"last {losses[-1]:.3f} vs {reference[-1]:.3f}")  # fmt: skip
    return ("pass" if ok else "fail"), summary, {"converted": converted, "worst": worst, "losses": losses,
                                                 "reference": reference}  # fmt: skip


def part_async_ckpt(device: Any, quick: bool) -> tuple[str, str, dict[str, Any]]:
    import tempfile

    import torch

    from kiln.checkpoint import save_checkpoint
    from kiln.checkpoint.async_save import start_async_save
    from kiln.checkpoint.staging import staging_buffers_for

    # CUDA: 4 blocks of 2048 (134M parameters, 1.6 GB with Adam's moments); CPU: 8M, 100 MB
    dim, depth = (128, 2) if quick else (2048, 4) if device.type == "cuda" else (512, 4)
    _, trainer = _trainer_losses(_blocks(dim, depth), _blocks_data(dim, 8), 8, 1, device=device.type)
    state = trainer.state
    size = sum(p.numel() * p.element_size() * 3 for p in state.model.parameters())  # weights + Adam's 2
    with tempfile.TemporaryDirectory() as folder:
        stalls, writes = [], []
        # The background saves first: the first pays for the buffers and the one-time setup (the
        # save group, imports), the second reuses them; the synchronous save last, on warm code.
        for i in range(2):
            start = time.perf_counter()
            pending = start_async_save(Path(folder) / "async", state, "sharded", name=f"save{i}")
            stalls.append(time.perf_counter() - start)
            error = pending.wait()
            writes.append(time.perf_counter() - start)
            if error is not None:
                raise error
            if i == 0:
                allocated = staging_buffers_for(state.engine.model).num_allocated
        start = time.perf_counter()
        save_checkpoint(Path(folder) / "sync", state, "sharded", name="sync")
        sync_s = time.perf_counter() - start
    pool = staging_buffers_for(state.engine.model)
    buffers = pool.free_buffers()
    reused = pool.num_allocated == allocated
    # The GPU tensors' buffers are pinned, the others plain (Adam keeps its step counts on the host
    # unless fused or capturable).
    moments = [t for s in state.optimizers[0].state_dict()["state"].values() for t in s.values()]
    on_gpu = sum(t.is_cuda for t in [*state.model.parameters(), *moments] if isinstance(t, torch.Tensor))
    pinned = sum(b.is_pinned() for b in buffers)
    ok = reused and stalls[1] < sync_s and pinned == on_gpu
    summary = (f"{size / 1e9:.2f} GB: synchronous save {sync_s:.2f} s; background save stalls training "
               f"{stalls[0]:.2f} s (first), {stalls[1]:.2f} s (buffers reused: {reused}), written in "
               f"{writes[1]:.2f} s; {len(buffers)} buffers, {pinned} pinned ({on_gpu} tensors on the GPU)")  # fmt: skip
    details = {"bytes": size, "sync_s": sync_s, "stall_s": stalls, "write_s": writes, "pinned": pinned,
               "on_gpu": on_gpu}  # fmt: skip
    return ("pass" if ok else "fail"), summary, details


FUNCTIONS = {
    "precision": part_precision,
    "fsdp2_bf16": part_fsdp2_bf16,
    "compile_ckpt": part_compile_ckpt,
    "fp8": part_fp8,
    "async_ckpt": part_async_ckpt,
}


def run_part(name: str, files: Path, quick: bool) -> None:
    """In the child: run one part and write ``files/result.json``."""
    import torch

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared machine: a multi-threaded op waits for its slowest thread
    status, summary, details = FUNCTIONS[name](device, quick)
    (files / "result.json").write_text(json.dumps({"status": status, "summary": summary, "details": details}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=sorted(FUNCTIONS))
    parser.add_argument("files", type=Path, help="the folder result.json goes to")
    parser.add_argument("--quick", action="store_true", help="the smallest workloads")
    args = parser.parse_args()
    run_part(args.part, args.files, args.quick)


if __name__ == "__main__":
    sys.exit(main())
