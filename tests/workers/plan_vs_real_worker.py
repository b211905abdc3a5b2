"""The real side of tests/test_plan_vs_real.py: each configuration of a JSON file trained for one step
on real gloo processes, through the Trainer that ``kiln train`` builds, measured independently of
the dry run:

* parameters, gradients and optimizer state: the bytes of their storages after the step;
* activations: the CPU allocator's peak during the step's forwards and backwards (torch.profiler's
  memory timeline, as tests/test_activation_estimate.py measures), less the gradients;
* collectives: a wrapper around each collective function of ``torch.distributed`` and of
  ``torch.distributed._functional_collectives`` (what DTensor calls), counting its bytes.

``python plan_vs_real_worker.py CONFIGS.json OUT``, under ``kiln run -n N``: writes OUT/<name>-<rank>.json.
A configuration whose setup raises records the error's message instead.
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.config.args import load_trainer_args
from kiln.config.trainer_builder import build_trainer
from kiln.planning.comm_count import mesh_dimension
from kiln.planning.dry_run import first_microbatch, mesh_sizes, storage_bytes

# -- the counting wrapper --------------------------------------------------------------------------
counts: dict[str, dict[str, int]] = {}
sizes: dict[str, int] = {}
_depth = [0]


def _group(group: Any) -> Any:
    """A process group from what the functions take: a group, None (the world), a group name, a
    DeviceMesh, (mesh, dim) or a list of ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    if group is None:
        return dist.group.WORLD
    if isinstance(group, tuple) and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


def _nbytes(t: Any) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size()


# name -> (kind, the argument whose bytes a call moves); a functional all-gather moves its input
# times the group's size (the gathered output)
_DIST = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "broadcast": ("broadcast", "tensor"),
    "send": ("p2p", "tensor"),
    "recv": ("p2p", "tensor"),
    "isend": ("p2p", "tensor"),
    "irecv": ("p2p", "tensor"),
}
_FUNCOL = {
    "all_reduce": ("all_reduce", "self"),
    "all_gather_tensor": ("all_gather", "self"),
    "all_gather_tensor_autograd": ("all_gather", "self"),
    "reduce_scatter_tensor": ("reduce_scatter", "self"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "self"),
    "all_to_all_single": ("all_to_all", "self"),
}


def _wrap(module: Any, name: str, kind: str, argument: str) -> None:
    original = getattr(module, name)
    signature = inspect.signature(original)

    @functools.wraps(original)
    def counted(*args: Any, **kwargs: Any) -> Any:
        _depth[0] += 1
        try:
            if _depth[0] == 1:  # the outermost call only: a collective made of collectives counts once
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                ranks = dist.get_process_group_ranks(_group(bound.arguments["group"]))
                nbytes = _nbytes(bound.arguments[argument])
                if module is funcol and kind == "all_gather":
                    nbytes *= len(ranks)
                dimension = mesh_dimension(ranks, sizes)
                counts.setdefault(kind, {}).setdefault(dimension, 0)
                counts[kind][dimension] += nbytes
            return original(*args, **kwargs)
        finally:
            _depth[0] -= 1

    setattr(module, name, counted)


def install() -> None:
    for name, (kind, argument) in _DIST.items():
        # torch.distributed's names are distributed_c10d's; both are wrapped, so that a call through
        # either is counted and P2POp, which checks its op against distributed_c10d's isend, accepts it
        _wrap(dist.distributed_c10d, name, kind, argument)
        setattr(dist, name, getattr(dist.distributed_c10d, name))
    for name, (kind, argument) in _FUNCOL.items():
        _wrap(funcol, name, kind, argument)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# -- one configuration ------------------------------------------------------------------------------
def allocator_peak(prof: Any, exclude: set[int]) -> int:
    """The most bytes the CPU allocator held at once in the window, above what it held before: every
    allocation (+) and free (-) the profiler recorded, in time order, leaving out the last allocation
    at each address of ``exclude`` (the gradients, which outlive the window).

    A copy a collective makes (gloo's reduce-scatter copies its input; a functional all-reduce clones
    its input into its output) is also held by the gloo work, and the profiler records no free made on
    gloo's thread: when that thread is the last to let go of one (on a busy machine it often is; CI
    measured +12%), the copy seems to live to the end of the window, and its address is handed out
    again. Such a copy is counted as freed when its collective returned, as the dry run (whose
    collectives complete at once) counts it."""
    from torch._C._profiler import _EventType

    def walk(nodes: Any, collective: int | None) -> Any:
        for node in nodes:
            inside = node.end_time_ns if node.name.startswith(("c10d::", "_c10d_functional::")) else collective
            yield node, inside
            yield from walk(node.children, inside)

    events = sorted(
        (e.start_time_ns, e.typed[1].alloc_size, e.typed[1].ptr, collective)
        for e, collective in walk(prof.profiler.kineto_results.experimental_event_tree(), None)
        if e.typed[0] == _EventType.Allocation
    )
    records, held = [], {}  # held: address -> (bytes, its collective's end) of a copy not yet freed
    for t, size, ptr, collective in events:
        if size > 0 and ptr in held:  # its address handed out again: its free was not recorded
            nbytes, end = held.pop(ptr)
            records.append((end, -nbytes, ptr))
        if size > 0 and collective is not None:
            held[ptr] = (size, collective)
        elif size < 0:
            held.pop(ptr, None)
        records.append((t, size, ptr))
    records += [(end, -nbytes, ptr) for ptr, (nbytes, end) in held.items()]
    records.sort()
    last = {ptr: i for i, (_, size, ptr) in enumerate(records) if ptr in exclude and size > 0}
    skip = set(last.values())
    live = peak = 0
    for i, (_, nbytes, _) in enumerate(records):
        if i not in skip:
            live += nbytes
            peak = max(peak, live)
    return peak


def measure(cfg: dict[str, Any], world_size: int) -> dict[str, Any]:
    args = load_trainer_args(cfg, world_size=world_size)
    trainer = build_trainer(args)
    engine = trainer.engine
    sizes.clear()
    sizes.update(mesh_sizes(engine.strategy, world_size))
    microbatch = first_microbatch(args)
    microbatches = [microbatch] * (args.grad_accumulation_steps or 1)
    from kiln.core.model import Model

    if isinstance(engine.module, Model):

        def loss_of(mb: Any) -> torch.Tensor:
            return engine.criterion(engine(mb), mb)
    else:

        def loss_of(mb: Any) -> torch.Tensor:
            return engine.criterion(engine(mb[0]), mb[1])

    pipeline = getattr(engine.strategy, "pipeline", None)
    if pipeline is not None and not pipeline.built:
        engine.train_step(microbatches, loss_of)  # the stages are built on the first step, as in the dry run
    peaks, steps = [], []
    for _ in range(REPEATS):
        peak, step_counts = _measured_step(engine, microbatches, loss_of)
        peaks.append(peak)
        steps.append(step_counts)
    params = list(engine.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    trainer.close()
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(grads),
        "optimizer": storage_bytes(state),
        "activations": min(peaks),
        "activation_peaks": peaks,
        "collectives": steps[0],
        "same_collectives_every_step": all(c == steps[0] for c in steps),
    }


# A copy a collective makes is counted as freed when its collective returns (allocator_peak), but a
# buffer the caller hands to gloo (an FSDP all-gather's output) can still outlive its last use by a
# few allocations when gloo's thread lets go of it late. The least of a few steps is the step whose
# buffers were freed as soon as they could be, which is what the dry run counts.
REPEATS = 3


def _measured_step(engine: Any, microbatches: list[Any], loss_of: Any) -> tuple[int, dict[str, dict[str, int]]]:
    """One training step: (the allocator's peak in its forwards and backwards, less the gradients;
    the bytes of its collectives)."""
    if engine.optimizer is not None:
        engine.optimizer.zero_grad(set_to_none=True)  # the step's own zero_grad would free them in the window
    counts.clear()
    gc.collect()  # no garbage of the setup is freed in the window, and none of the step's is late:
    gc.disable()  # every tensor of the step is freed by its last reference, as the dry run counts it
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    prof.start()
    stopped = []

    def stop(_: Any) -> None:
        prof.stop()
        stopped.append(True)

    try:
        engine.train_step(microbatches, loss_of, after_microbatches=stop)
    finally:
        gc.enable()
    assert stopped
    grads = [p.grad for p in engine.model.parameters() if p.grad is not None]
    grad_ptrs = {_local(g).untyped_storage().data_ptr() for g in grads}
    return allocator_peak(prof, grad_ptrs), json.loads(json.dumps(counts))


def main() -> None:
    # What the warm server imported (torch, transformers: millions of objects) is never garbage here:
    # frozen, the collection before each measured step scans only what this job made (it scanned
    # them all, 0.5 CPU-s a collection)
    gc.freeze()
    # the source stack fx records for each node of a pipeline's trace is for a reader of the graph,
    # which nothing here is (the dry run's traces leave it out too: kiln.planning.shared_trace)
    torch.fx.config.do_not_emit_stack_traces = True
    configs, out = json.load(open(sys.argv[1])), sys.argv[2]
    ctx = kiln.launch_from_torch(backend="gloo")
    install()
    for name, cfg in configs.items():
        try:
            result = measure(cfg, ctx.world_size)
        except (ValueError, TypeError) as exc:
            result = {"error": str(exc)}
        with open(f"{out}/{name}-{ctx.rank}.json", "w") as f:
            json.dump(result, f)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
