"""Tied weights across pipeline stages: Megatron-LM's embedding group.

A model that ties its input embedding to its LM head (a Hugging Face model with
``tie_word_embeddings=True``: ``lm_head.weight is embed_tokens.weight``) reads one weight in its first
stage and in its last. ``torch.distributed.pipelining`` copies a parameter that several stages read
into each of them, so that no two stages share a tensor, and then each copy gets the gradient of its
own stage's use only, where one process adds both uses into the one weight. As Megatron-LM does with
its embedding group, the copies' gradients are summed over the ranks that hold them once a step:
after the step's last backward (every microbatch and every accumulated backward, once the stages'
data-parallel sync has run) and before clipping and the optimizer. Each copy then holds the gradient
one process would give the tied weight, and the same optimizer on the same gradient keeps the copies
equal ever after.

* Within a stage a tied weight is one tensor: torch leaves the first stage the head as well (the
  model's tensor under its other name, which the stage never reads). It is dropped
  (:func:`keep_read_copies`): an optimizer or a checkpoint would take it for the embedding and it
  would never change.
* The ranks of one pipeline that hold a copy (the first and the last stage's: the same other mesh
  coordinates, so the same data-parallel and tensor-parallel shards) sum over a process group of
  their own, created for every pipeline of the world at once. A V-shaped schedule (``zbv``,
  ``dualpipev``) puts the first and the last stage on one rank: the sum is local.
* Data or tensor parallelism inside the stages: the copies are sharded alike (one tensor-parallel
  style for both, FSDP's rows), so their local shards are summed; a tied weight whose copies are
  laid out differently is refused in one line at the first step.
* The gradient norm counts each tied weight once (:attr:`TiedWeights.uncounted`: the copies but the
  first stage's are clipped with the others and left out of the norm).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TiedWeights", "keep_read_copies", "pipeline_ranks", "tied_names"]


def tied_names(model: nn.Module) -> list[tuple[str, ...]]:
    """The names of each parameter ``model`` holds under more than one name (tied embeddings),
    in ``named_parameters`` order; taken before the cut, which copies them."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def pipeline_ranks(mesh: Any) -> list[list[int]]:
    """The global ranks of every pipeline of a ``DeviceMesh`` with a ``"pp"`` dimension, each in
    pipeline-rank order: the same list on every rank (groups are created by all ranks together)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    dim = mesh.mesh_dim_names.index("pp")
    with unset_fake_temporarily():  # a dry run's fake mode would make the rank table a fake tensor
        return mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()


def _read_names(stage: nn.Module) -> tuple[set[str], set[str]]:
    """The parameter names ``stage``'s traced graphs read (``get_attr``) and the modules they call."""
    read: set[str] = set()
    called: set[str] = set()
    for prefix, module in stage.named_modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        scope = f"{prefix}." if prefix else ""
        for node in graph.nodes:
            if node.op == "get_attr":
                read.add(scope + str(node.target))
            elif node.op == "call_module":
                called.add(scope + str(node.target))
    return read, called


def _holds(stage: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    try:
        module = stage.get_submodule(owner)
    except AttributeError:
        return False
    return module._parameters.get(leaf) is not None


def _drop(stage: nn.Module, name: str, called: set[str]) -> None:
    """Remove parameter ``name`` from ``stage``, then each module on its path left empty (no
    parameter, buffer or child) that no graph calls."""
    owner, _, leaf = name.rpartition(".")
    del stage.get_submodule(owner)._parameters[leaf]
    while owner and owner not in called:
        module = stage.get_submodule(owner)
        if module._parameters or module._buffers or module._modules:
            return
        parent, _, child = owner.rpartition(".")
        del stage.get_submodule(parent)._modules[child]
        owner = parent


def keep_read_copies(stages: Mapping[int, nn.Module], tied: Sequence[tuple[str, ...]]) -> list[dict[int, str]]:
    """Each stage's tied weights as one tensor each, under a name the stage reads; returns, for each
    tied weight of ``tied``, ``{stage: name}`` of the stages that hold a copy.

    ``stages`` are the cut's stage modules by index, before they are built (their graphs say what
    they read). A name a stage holds but never reads (the first stage's head) is dropped; names the
    stage reads are pointed at one tensor (torch copies a parameter that two stages read under one
    name only)."""
    holders: list[dict[int, str]] = [{} for _ in tied]
    for index, stage in stages.items():
        read, called = _read_names(stage)
        for names, held in zip(tied, holders, strict=True):
            present = [n for n in names if _holds(stage, n)]
            kept = [n for n in present if n in read]
            for name in present:
                if name not in kept:
                    _drop(stage, name, called)
            if not kept:
                continue
            one = stage.get_parameter(kept[0])
            for name in kept[1:]:
                owner, _, leaf = name.rpartition(".")
                stage.get_submodule(owner)._parameters[leaf] = one
            held[index] = kept[0]
    return holders


@dataclass
class _Tied:
    """One tied weight on this rank: its copies here (in stage order) and the group that sums them."""

    names: tuple[str, ...]
    params: list[nn.Parameter]
    labels: list[str]  # each copy's name and stage, for messages
    group: dist.ProcessGroup | None  # the other ranks that hold copies; None: every copy is here
    counted: bool  # whether the first copy here is the first stage's, the one the norm counts


@dataclass
class TiedWeights:
    """This rank's copies of the model's tied weights, and the sum of their gradients.

    Build it with :meth:`build` on every rank of the world at once (it creates process groups);
    :meth:`sum_grads` then runs on every rank after the step's last backward."""

    tied: list[_Tied] = field(default_factory=list)

    @property
    def uncounted(self) -> list[nn.Parameter]:
        """The copies whose gradients the norm leaves out: each tied weight is counted once, on
        the first stage that holds it (the others hold the same gradient after :meth:`sum_grads`)."""
        return [p for t in self.tied for p in (t.params[1:] if t.counted else t.params)]

    @classmethod
    def build(
        cls,
        holders: Sequence[Mapping[int, str]],
        tied: Sequence[tuple[str, ...]],
        stages: Mapping[int, nn.Module],
        place: Callable[[int], int],
        pipelines: Sequence[Sequence[int]],
        pp_rank: int,
    ) -> TiedWeights:
        """The copies on this rank, after the stages' sharding steps.

        Args:
            holders: :func:`keep_read_copies`' answer (the same on every rank: every rank traces
                the whole model).
            tied: the tied weights' names (:func:`tied_names`).
            stages: this rank's stage modules by stage index.
            place: ``fn(stage) -> pipeline rank`` that holds the stage.
            pipelines: the global ranks of every pipeline of the world, in pipeline-rank order.
            pp_rank: this rank's place in its pipeline.
        """
        mine = next(ranks for ranks in pipelines if ranks[pp_rank] == dist.get_rank())
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for held in holders:
            spread = tuple(sorted({place(stage) for stage in held}))
            if len(spread) < 2 or spread in groups:
                continue
            # every rank creates every pipeline's group, in the same order (a collective of the world)
            for ranks in pipelines:
                group = dist.new_group([ranks[r] for r in spread])
                if ranks is mine and pp_rank in spread:
                    groups[spread] = group
            groups.setdefault(spread, None)
        result = cls()
        for names, held in zip(tied, holders, strict=True):
            spread = tuple(sorted({place(stage) for stage in held}))
            if pp_rank not in spread:
                continue
            here = [s for s in sorted(held) if s in stages]
            params = [stages[s].get_parameter(held[s]) for s in here]
            labels = [f"{held[s]} on stage {s}" for s in here]
            result.tied.append(_Tied(names, params, labels, groups.get(spread), counted=min(held) in stages))
        result._check_layouts()
        return result

    def _check_layouts(self) -> None:
        """Refuse copies that are not laid out alike (their local shards could not be summed)."""
        from torch._subclasses.fake_tensor import is_fake

        for t in self.tied:
            layouts = {f"{label}: {_layout(p)}" for label, p in zip(t.labels, t.params, strict=True)}
            kinds = {_layout(p) for p in t.params}
            # a dry run's fake tensors hold no values to compare (its ranks run one plan anyway)
            if t.group is not None and not is_fake(_local(t.params[0])):
                code = zlib.crc32(repr(sorted(kinds)).encode())
                bounds = torch.tensor([code, -code], dtype=torch.int64, device=_device(t.params[0]))
                dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=t.group)
                if int(bounds[0]) != -int(bounds[1]):  # the largest code is not the smallest
                    gathered: list[Any] = [None] * dist.get_world_size(t.group)
                    dist.all_gather_object(gathered, sorted(layouts), group=t.group)
                    layouts = {layout for part in gathered for layout in part}
                    kinds = {layout.split(": ", 1)[1] for layout in layouts}
            if len(kinds) > 1:
                raise ValueError(
                    f"tied weight {' = '.join(t.names)}: its copies on the pipeline's stages are laid out "
                    f"differently ({'; '.join(sorted(layouts, key=_stage))}), so their gradients cannot be summed; give the "
                    "input embedding and the LM head the same tensor-parallel style (or leave both out of "
                    "tp_plan, as kiln's sequence-parallel plan does for tied embeddings), or untie them "
                    "(tie_word_embeddings=False)"
                )

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Every copy's gradient becomes the sum of all copies' (here and on the group's ranks)."""
        for t in self.tied:
            grads = [_local(_grad(p)) for p in t.params]
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            if t.group is not None:
                dist.all_reduce(total, group=t.group)
            if len(grads) > 1:
                for grad in grads:
                    grad.copy_(total)


def _stage(layout: str) -> int:
    # "<name> on stage <n>: <layout>" -> n, to list the copies in stage order
    return int(layout.split(" on stage ", 1)[1].split(":", 1)[0])


def _device(p: torch.Tensor) -> torch.device:
    return _local(p).device


def _local(t: torch.Tensor) -> torch.Tensor:
    # under no_grad a DTensor's to_local() is its own local tensor: writing to it writes the shard
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _grad(p: nn.Parameter) -> torch.Tensor:
    # a copy without a gradient (its stage saw no batch) joins the sum with zeros
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _layout(p: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    dtype = str(p.dtype).replace("torch.", "")
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        dims = ", ".join(f"{n}={s}" for n, s in zip(mesh.mesh_dim_names or (), mesh.shape, strict=False))
        placements = ", ".join(map(str, p.placements))
        return f"{dtype} {list(p.shape)} as {placements} over ({dims or tuple(mesh.shape)})"
    return f"{dtype} {list(p.shape)} whole (a plain tensor)"
