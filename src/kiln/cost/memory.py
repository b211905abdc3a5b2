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

A is the activation memory of one microbatch, per rank: the most bytes alive during one forward
and backward of ``example_input``, measured on fake tensors (no memory, no compute; see
:mod:`kiln.cost.activations`), less the gradients (0 when no example is given). Every
data-parallel rank runs its own microbatch, so each row carries the whole of it.

``auto`` takes, of the rows that fit the budget, the one whose step costs least by the cost model
of ``kiln plan --search`` (:func:`kiln.cost.step_time.data_parallel_seconds`: each strategy's
collectives over the link the world crosses, plus the recomputed forward of checkpointing, with the
constants of :mod:`kiln.cost.devices` for this machine's device class); a tie goes to the
earlier row. Never ``tp``, which needs every rank of a tensor-parallel group to read the same batch.
zero2 moves the gradients once and the parameters once, as DDP's all-reduce does (2 x their bytes),
so it ties with ddp (ddp first) and costs less than zero1 (which adds a parameter gather to DDP's
all-reduce) in less memory: auto never picks zero1 over it.
With an example and no ``activation_checkpointing`` chosen, each row also has a ``+ckpt`` twin:
the same strategy with every block checkpointed (A measured that way; one more forward of compute,
2 x parameters x tokens FLOPs, tokens being the elements of the example's token ids or its rows).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kiln.cost.activations import ActivationEstimate, estimate_activations

__all__ = [
    "PlanRow",
    "ActivationEstimate",
    "plan_table",
    "choose",
    "optimizer_state_factor",
    "activation_bytes",
    "memory_budget",
    "format_table",
    "choice_line",
    "activation_summary",
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
    why: str = ""  # the chosen row: why it was chosen (choose() sets it)
    options: dict[str, Any] = field(default_factory=dict)  # what the strategy needs besides its name
    estimate: ActivationEstimate | None = None  # how ``activations`` was measured (None: no example)
    seconds: float | None = None  # the cost model's communication + recomputation per step (None: not priced)

    @property
    def label(self) -> str:
        """The row's name in the table: the strategy, ``+ckpt`` with activation checkpointing."""
        return self.strategy + ("+ckpt" if self.options.get("activation_checkpointing") else "")


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


def activation_bytes(model: nn.Module, example_input: Any, activation_checkpointing: Any = None) -> int:
    """Activation bytes of one microbatch: the peak of one forward and backward of ``example_input``
    less the gradients, on fake tensors (:func:`kiln.cost.activations.estimate_activations`)."""
    return estimate_activations(model, example_input, activation_checkpointing=activation_checkpointing).peak


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
    from kiln.parallel.transforms.parallelize import find_blocks

    sizes = [sum(p.numel() * p.element_size() for p in model.get_submodule(n).parameters()) for n in find_blocks(model)]
    return max(sizes, default=sum(p.numel() * p.element_size() for p in model.parameters()))


def _tp_split_bytes(model: nn.Module) -> int:
    # Bytes of the parameters the model's own tp_plan splits (0 without a plan).
    from kiln.parallel.transforms.tensor_parallel import matching_modules

    plan = getattr(model, "tp_plan", None)
    if not plan:
        return 0
    names = {n for pattern, style in plan.items() if str(style) != "sequence" for n in matching_modules(model, pattern)}
    return sum(p.numel() * p.element_size() for n in names for p in model.get_submodule(n).parameters())


def _activation_estimates(
    model: nn.Module, example_input: Any, activation_checkpointing: Any
) -> tuple[ActivationEstimate | None, ActivationEstimate | None]:
    """(the estimate the rows use, the ``+ckpt`` rows' one or None): checkpointing is offered when
    the user chose none and it lowers the peak (a model without blocks has nothing to checkpoint)."""
    if example_input is None:
        return None, None
    estimate = estimate_activations(model, example_input, activation_checkpointing=activation_checkpointing)
    if activation_checkpointing is not None or estimate.peak == 0:
        return estimate, None
    try:
        checkpointed = estimate_activations(model, example_input, activation_checkpointing="full")
    except ValueError:  # no blocks to checkpoint
        return estimate, None
    return estimate, checkpointed if checkpointed.peak < estimate.peak else None


def plan_table(
    model: nn.Module,
    optimizer_cls: Any = torch.optim.AdamW,
    world_size: int = 1,
    budget: int | float | None = None,
    example_input: Any = None,
    activation_checkpointing: Any = None,
    devices_per_node: int | None = None,
) -> list[PlanRow]:
    """Every candidate strategy with its memory per rank; the chosen one has ``chosen=True`` and its
    ``note`` says why.

    Args:
        model: the model (its parameters are counted where they are; nothing is moved).
        optimizer_cls: an optimizer class or instance (its state size per parameter).
        world_size: ranks the run will have.
        budget: bytes per rank (default: :func:`memory_budget`).
        example_input: one microbatch, to measure activations (see
            :func:`kiln.cost.activations.estimate_activations` for its form).
        activation_checkpointing: the run's choice (``"full"``, ``"selective"``, ...): activations are
            measured with it, and no ``+ckpt`` rows are added. None: rows without checkpointing,
            and with an example, ``+ckpt`` rows with every block checkpointed.
        devices_per_node: ranks that share a node's fast links (default: all of ``world_size``).

    Example::

        for row in plan_table(model, torch.optim.AdamW, world_size=8, budget=40e9): print(row)
    """
    params = [p for p in model.parameters()]
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    g_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    # optimizer state is kept in the parameters' dtype by torch optimizers
    factor = optimizer_state_factor(optimizer_cls)
    o_bytes = factor * g_bytes
    estimate, checkpointed = _activation_estimates(model, example_input, activation_checkpointing)
    w = max(int(world_size), 1)
    # (strategy, params, grads, optimizer state, note): the memory that does not depend on the batch
    candidates: list[tuple[str, int, int, int, str]] = []
    if w == 1:
        candidates.append(("single", p_bytes, g_bytes, o_bytes, "one rank"))
    else:
        block = _largest_block(model)
        shard = lambda n: math.ceil(n / w)  # noqa: E731
        candidates += [
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
    act = estimate.peak if estimate is not None else 0
    options = {"activation_checkpointing": activation_checkpointing} if activation_checkpointing is not None else {}
    rows = [
        PlanRow(
            name, p, g, o, act, p + g + o + act, note=note, eligible=name != "tp", options=options, estimate=estimate
        )
        for name, p, g, o, note in candidates
    ]
    if checkpointed is not None:
        rows += [
            PlanRow(
                name,
                p,
                g,
                o,
                checkpointed.peak,
                p + g + o + checkpointed.peak,
                note=f"{note}; every block checkpointed (one more forward in the backward)",
                options={"activation_checkpointing": "full"},
                estimate=checkpointed,
            )
            for name, p, g, o, note in candidates
            if name != "tp"
        ]
    limit = memory_budget(budget)
    _price_rows(rows, p_bytes, g_bytes, w, example_input, sum(p.numel() for p in params), devices_per_node)
    for row in rows:
        row.fits = limit is None or row.total <= limit
    choose(rows, limit)
    return rows


def _example_tokens(example: Any) -> int:
    # the elements of the example's first integer tensor (token ids), else its first tensor's rows
    tensors = [t for t in torch.utils._pytree.tree_leaves(example) if isinstance(t, torch.Tensor)]
    ids = next((t for t in tensors if not t.is_floating_point() and t.dim() > 0), None)
    if ids is not None:
        return ids.numel()
    return int(tensors[0].shape[0]) if tensors and tensors[0].dim() > 0 else 1


def _price_rows(
    rows: list[PlanRow],
    p_bytes: int,
    g_bytes: int,
    world_size: int,
    example_input: Any,
    num_parameters: int,
    devices_per_node: int | None,
) -> None:
    """Each row's seconds per step by the search's cost model, on this machine's device class."""
    from kiln.cost.devices import device_class_of
    from kiln.cost.step_time import data_parallel_seconds

    device = device_class_of(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    tokens = _example_tokens(example_input) if example_input is not None else 0
    for row in rows:
        # a mode the user chose costs every row the same recomputation; the +ckpt rows' is what they add
        recompute = 2.0 * num_parameters * tokens if row.options.get("activation_checkpointing") else 0.0
        row.seconds = data_parallel_seconds(
            row.strategy,
            p_bytes,
            g_bytes,
            world_size,
            device,
            devices_per_node=devices_per_node or max(world_size, 1),
            recompute_flops=recompute,
        )


def choose(rows: list[PlanRow], limit: int | None = None) -> PlanRow:
    """Mark and return the row auto takes: of those that fit and auto may take, the least seconds
    per step by the cost model (the earlier row on a tie; in order where rows are not priced), or
    the smallest one if none fits."""
    budget = "no known limit" if limit is None else f"the budget of {_fmt(limit)} per rank"
    candidates = [r for r in rows if r.eligible]
    fitting = [r for r in candidates if r.fits]
    if fitting:
        pick = min(fitting, key=lambda r: (r.seconds if r.seconds is not None else 0.0, candidates.index(r)))
        skipped = [r.label for r in candidates[: candidates.index(pick)] if not r.fits]
        cost = f" ({pick.seconds * 1e3:.3g} ms per step by the cost model)" if pick.seconds is not None else ""
        why = (
            f"fits {budget}"
            + (f"; {', '.join(skipped)} would not" if skipped else "")
            + (f"; least communication and recomputation of those that fit{cost}" if len(rows) > 1 else "")
        )
    else:
        pick = min(candidates, key=lambda r: r.total)
        why = f"nothing fits {budget}; the smallest estimate (add ranks, shrink the microbatch or use bf16)"
    plain = [r for r in candidates if not r.options.get("activation_checkpointing")]
    if pick.options.get("activation_checkpointing") and plain:
        # why checkpointing: the activations' share of the smallest row without it
        smallest = min(plain, key=lambda r: r.total)
        why += (
            f"; activations are {smallest.activations / max(smallest.total, 1):.0%} of {smallest.label}'s "
            f"{_fmt(smallest.total)}, checkpointing every block brings them from "
            f"{_fmt(smallest.activations)} to {_fmt(pick.activations)}"
        )
    pick.chosen, pick.why = True, why
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
            ("* " if r.chosen else "  ") + r.label,
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


def choice_line(rows: list[PlanRow]) -> str:
    """The chosen row in one line, what a run prints (``format_table`` has every candidate)."""
    row = next(r for r in rows if r.chosen)
    return f"strategy='auto' chose {row.label}, {_fmt(row.total)} per rank: {row.why}"


def activation_summary(rows: list[PlanRow]) -> str:
    """One line on how the activations of the rows were measured (empty without an example)."""
    seen: dict[str, ActivationEstimate] = {}
    for row in rows:
        if row.estimate is not None:
            seen.setdefault(str(row.estimate.activation_checkpointing), row.estimate)
    parts = []
    for estimate in seen.values():
        ac = estimate.activation_checkpointing
        how = "without checkpointing" if ac is None else f"activation_checkpointing={ac!r}"
        parts.append(f"{how}: {_fmt(estimate.peak)} at the peak ({_fmt(estimate.saved)} saved for the backward)")
    if not parts:
        return ""
    method = next(iter(seen.values())).method
    return f"activations of one microbatch per rank, one forward and backward on {method}; " + "; ".join(parts)
