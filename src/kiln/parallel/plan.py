"""Memory per rank of each strategy, and the choice ``strategy="auto"`` makes (``kiln plan``).

Estimates, per rank, in bytes (P = parameter bytes, W = ranks, k = optimizer state per parameter):

========  ===============================================================  =====================
strategy  memory                                                           communication / step
========  ===============================================================  =====================
single    P + G + kP + A                                                   none
ddp       P + 2G + kP + A   (DDP's gradient buckets are a second copy)     all-reduce G
zero1     P + 2G + kP/W + A                                                all-reduce G + gather P
zero2     P/W + P + G/W + kP/W + A  (gathered parameters kept to backward) reduce-scatter + gather
zero3     P/W + 2B + G/W + B + kP/W + A  (B: the largest block)          zero2 + a second gather
tp        split layers /W      (shown when the model has a ``tp_plan``)   per-layer activations
========  ===============================================================  =====================

A is the activation memory of one microbatch, measured from the tensors autograd saves during
one forward of ``example_input`` (0 when none is given). ``auto`` takes the first row, in the order
above (least communication first), that fits the budget; never ``tp``, which needs every rank of a
tensor-parallel group to read the same batch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "PlanRow",
    "plan_table",
    "choose",
    "optimizer_state_factor",
    "activation_bytes",
    "memory_budget",
    "format_table",
]

# Optimizer state tensors per parameter, by class name (Adam-family: two moments).
_STATE_FACTORS = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Lamb": 2,
    "LAMB": 2,
    "Adagrad": 1,
    "RMSprop": 1,
    "Rprop": 2,
    "ASGD": 1,
    "SparseAdam": 2,
    "Adafactor": 1,
    "LBFGS": 2,
}
BUDGET_ENV = "KILN_MEMORY_BUDGET_BYTES"


@dataclass
class PlanRow:
    """One candidate strategy: estimated bytes per rank and whether it fits."""

    strategy: str
    params: int
    grads: int
    optimizer: int
    activations: int
    total: int
    fits: bool = True
    chosen: bool = False
    eligible: bool = True  # auto may pick it (tp changes which batch each rank must read: never automatic)
    note: str = ""
    options: dict[str, Any] = field(default_factory=dict)


def optimizer_state_factor(optimizer: Any) -> int:
    """State tensors per parameter for an optimizer class or instance (SGD: its momentum buffer)."""
    if optimizer is None:
        return 0
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    name = cls.__name__
    if name == "SGD":
        defaults = getattr(optimizer, "defaults", {}) if not isinstance(optimizer, type) else {}
        return 1 if defaults.get("momentum", 0) else 0
    if name == "ZeroRedundancyOptimizer":
        return optimizer_state_factor(getattr(optimizer, "optim", None))
    return _STATE_FACTORS.get(name, 2)  # unknown: assume Adam-like rather than under-count


def activation_bytes(model: nn.Module, example_input: Any) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward of ``example_input``."""
    # Parameters (and views of them, like the transposed weight a Linear saves) are counted already.
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:  # a tensor saved twice is held once
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    args = example_input if isinstance(example_input, tuple) else (example_input,)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*args)
    return total


def memory_budget(
    budget: int | float | None = None, device: torch.device | None = None, local_world_size: int = 1
) -> int | None:
    """The bytes one rank may use: ``budget``, else ``$KILN_MEMORY_BUDGET_BYTES``, else the free
    memory of the CUDA device (or the host's available memory shared by the local ranks)."""
    if budget is not None:
        return int(budget)
    if os.environ.get(BUDGET_ENV):
        try:
            return int(float(os.environ[BUDGET_ENV]))
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={os.environ[BUDGET_ENV]!r} is not a number of bytes") from None
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 // max(local_world_size, 1)
    except (OSError, KeyError, ValueError):
        return None  # unknown: everything fits


def _largest_block(model: nn.Module) -> int:
    from kiln.parallel.parallelize import find_blocks

    sizes = [sum(p.numel() * p.element_size() for p in model.get_submodule(n).parameters()) for n in find_blocks(model)]
    return max(sizes, default=sum(p.numel() * p.element_size() for p in model.parameters()))


def _tp_split_bytes(model: nn.Module) -> int:
    # Bytes of the parameters the model's own tp_plan splits (0 without a plan).
    from kiln.parallel.tensor import matching_modules

    plan = getattr(model, "tp_plan", None)
    if not plan:
        return 0
    names = {n for pattern, style in plan.items() if str(style) != "sequence" for n in matching_modules(model, pattern)}
    return sum(p.numel() * p.element_size() for n in names for p in model.get_submodule(n).parameters())


def plan_table(
    model: nn.Module,
    optimizer_cls: Any = torch.optim.AdamW,
    world_size: int = 1,
    budget: int | float | None = None,
    example_input: Any = None,
) -> list[PlanRow]:
    """Every candidate strategy with its memory per rank; the chosen one has ``chosen=True`` and its
    ``note`` says why.

    Args:
        model: the model (its parameters are counted where they are; nothing is moved).
        optimizer_cls: an optimizer class or instance (its state size per parameter).
        world_size: ranks the run will have.
        budget: bytes per rank (default: :func:`memory_budget`).
        example_input: one microbatch, to measure activations.

    Example::

        for row in plan_table(model, torch.optim.AdamW, world_size=8, budget=40e9): print(row)
    """
    params = [p for p in model.parameters()]
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    g_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # optimizer state is kept in the parameters' dtype by torch optimizers
    factor = optimizer_state_factor(optimizer_cls)
    o_bytes = factor * g_bytes
    act = activation_bytes(model, example_input) if example_input is not None else 0
    w = max(int(world_size), 1)
    rows: list[PlanRow] = []
    if w == 1:
        rows.append(
            PlanRow("single", p_bytes, g_bytes, o_bytes, act, p_bytes + g_bytes + o_bytes + act, note="one rank")
        )
    else:
        block = _largest_block(model)
        shard = lambda n: math.ceil(n / w)  # noqa: E731
        candidates = [
            ("ddp", p_bytes, 2 * g_bytes, o_bytes, "replicated; gradients all-reduced (buckets double them)"),
            ("zero1", p_bytes, 2 * g_bytes, shard(o_bytes), "optimizer state sharded"),
            (
                "zero2",
                shard(p_bytes) + p_bytes,
                shard(g_bytes),
                shard(o_bytes),
                "state and gradients sharded; parameters gathered from forward to backward",
            ),
            (
                "zero3",
                shard(p_bytes) + 2 * block,
                shard(g_bytes) + block,
                shard(o_bytes),
                "everything sharded; one block gathered at a time",
            ),
        ]
        split = _tp_split_bytes(model)
        if split:
            # only the planned layers are split; the rest stays whole on every rank
            p_tp = p_bytes - split + math.ceil(split / w)
            candidates.append(
                (
                    "tp",
                    p_tp,
                    p_tp,
                    factor * p_tp,
                    "the model's tp_plan; every layer communicates and every rank reads the same "
                    "batch, so auto never picks it: ask for strategy='tp' or Hybrid(tp=...)",
                )
            )
        for name, p, g, o, note in candidates:
            rows.append(PlanRow(name, p, g, o, act, p + g + o + act, note=note, eligible=name != "tp"))
    limit = memory_budget(budget)
    for row in rows:
        row.fits = limit is None or row.total <= limit
    choose(rows, limit)
    return rows


def choose(rows: list[PlanRow], limit: int | None = None) -> PlanRow:
    """Mark and return the least-communication row that fits (the smallest one if none fits)."""
    budget = "no known limit" if limit is None else f"the budget of {_fmt(limit)} per rank"
    candidates = [r for r in rows if r.eligible]
    fitting = [r for r in candidates if r.fits]
    if fitting:
        pick = fitting[0]
        skipped = [r.strategy for r in candidates[: candidates.index(pick)]]
        why = (
            f"fits {budget}"
            + (f"; {', '.join(skipped)} would not" if skipped else "")
            + ("; least communication of those that fit" if len(rows) > 1 else "")
        )
    else:
        pick = min(candidates, key=lambda r: r.total)
        why = f"nothing fits {budget}; the smallest estimate (add ranks, shrink the microbatch or use bf16)"
    pick.chosen = True
    pick.note = f"{pick.note}. CHOSEN: {why}" if pick.note else f"CHOSEN: {why}"
    return pick


def _fmt(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_table(rows: list[PlanRow]) -> str:
    """The rows as the text table ``kiln plan`` prints."""
    head = ("  strategy", "params", "grads", "optimizer", "activations", "total/rank", "fits", "why")
    body = [
        (
            ("* " if r.chosen else "  ") + r.strategy,
            _fmt(r.params),
            _fmt(r.grads),
            _fmt(r.optimizer),
            _fmt(r.activations),
            _fmt(r.total),
            "yes" if r.fits else "no",
            r.note,
        )
        for r in rows
    ]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head) - 1)]
    lines = [
        "  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + str(line[-1]) for line in [head, *body]
    ]
    return "\n".join(lines)
