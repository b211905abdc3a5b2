"""A run's first training step at its real world size, in this one CPU process (``--dry-run``).

``kiln plan -f run.yaml --world-size 512 --dry-run`` and ``kiln train -f run.yaml --dry-run`` run
the code a real launch runs, up to and through one optimizer step, as one rank of the world at a
time, on a fake process group and fake tensors (:mod:`kiln.planning.fake_world`):

1. the run file is read and checked as ``kiln train`` reads it, for the world size asked;
2. the model is built on the meta device (no weights: an 8B model costs nothing), and the
   optimizer over its parameters, by the config CLI's own builders;
3. the Trainer's Engine is built on them (:func:`kiln.trainer.building.build_engine`): strategy,
   mesh, and the parallelize steps in their order: placement (which turns the meta parameters into
   fake ones), float8, the pipeline cut, tensor parallelism, activation checkpointing, compile
   (*skipped*: nothing to compile for on fake tensors), FSDP;
4. one training step of the run's first microbatch (``grad_accumulation_steps`` of them, as the
   Trainer splits a batch), through :meth:`kiln.Engine.train_step`: forwards, backwards, gradient
   reduction, clipping and the optimizer step. A pipeline builds its stages on its first batch:
   under ``pp > 1`` that batch first builds them and sets up the schedule (its buffers and the
   warm-up exchange with the neighbouring stages) without running a microbatch
   (:meth:`~kiln.parallel.pipelining.runtime.PipelineRuntime.setting_up`), so the step measured
   is a run's steady one;
5. the checkpoint's save plan: the sharded state dict a save would write
   (``strategy.state_dict``) and DCP's local plan of it.

Any configuration error a real launch would hit is raised by the same code with the same message:
sizes that do not divide the world, heads that tensor parallelism cannot split, split points that
leave a stage empty, a mesh whose product is not the world. Nothing is written.

What is measured, per rank (bytes; see ``docs/planning.md`` for the JSON keys):

* ``params``, ``grads``, ``optimizer``: the storages this rank holds after the step (each storage
  once: FSDP2 pads its shards, and a block's gradients share one reduce-scatter buffer);
* ``activations``: the most bytes alive at once during the step's forwards and backwards, less
  the gradients: what autograd saves (with the run's checkpointing), FSDP's gathered parameters
  and communication buffers, and the backward's temporaries, measured storage by storage on the
  fake tensors as :mod:`kiln.cost.activations` does;
* ``peak``: parameters and optimizer state (held through every step of a run) plus the most bytes
  alive at once during the whole step, gradients and the optimizer's temporaries included;
* ``collectives``: the bytes each collective moves in the step, by kind and mesh dimension
  (:mod:`kiln.planning.comm_count`; a pipeline's sends and receives are counted as they run);
* ``checkpoint``: the tensor bytes and entries this rank's part of a sharded checkpoint holds.

The ranks measured are the first of each pipeline stage (rank 0 with no pipeline): the others of
a stage hold the same layers, as large or smaller shards (FSDP gives the first ranks the larger
ones), and move the same bytes.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from kiln.planning.comm_count import KINDS, CollectiveCounter
from kiln.planning.rank_workers import can_fork, default_workers, measure_ranks
from kiln.planning.shared_trace import CutOnly, SharedTraces, one_trace

if TYPE_CHECKING:
    from kiln.config.args import TrainerArgs
    from kiln.engine import Engine

__all__ = [
    "RankReport",
    "DryRunReport",
    "dry_run",
    "dry_run_rank",
    "measure_step",
    "first_microbatch",
    "mesh_sizes",
    "storage_bytes",
]


@dataclass(frozen=True)
class RankReport:
    """What one rank holds and moves in one training step (bytes).

    Args:
        rank: the rank measured.
        coordinates: its place on the mesh (``{"pp": 1, "dp_shard": 0, "tp": 0}``).
        params / grads / optimizer: the storages it holds after the step.
        activations: the most bytes alive at once during the forwards and backwards, less gradients.
        peak: ``params + optimizer`` plus the most bytes alive at once during the whole step.
        collectives: ``{kind: {mesh dimension: bytes}}`` moved in the step.
        calls: ``{kind: {mesh dimension: calls}}``.
        checkpoint_bytes / checkpoint_entries: this rank's share of a sharded checkpoint.
    """

    rank: int
    coordinates: dict[str, int]
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    collectives: dict[str, dict[str, int]]
    calls: dict[str, dict[str, int]]
    checkpoint_bytes: int
    checkpoint_entries: int


@dataclass(frozen=True)
class DryRunReport:
    """The dry run of one configuration: its settings and the ranks measured.

    ``to_dict()`` is what ``--json`` prints; ``format()`` the text ``kiln plan --dry-run`` prints.
    """

    world_size: int
    mesh: dict[str, int]
    strategy: str
    precision: str
    activation_checkpointing: str | None
    compile: str
    micro_batch_size: int
    grad_accumulation_steps: int
    num_parameters: int
    ranks: list[RankReport]
    seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        mesh = " x ".join(f"{name} {size}" for name, size in self.mesh.items() if size > 1) or "1 rank"
        lines = [
            f"dry run: {self.num_parameters:,} parameters on {self.world_size} ranks ({mesh}); strategy "
            f"{self.strategy}; precision {self.precision}; activation_checkpointing "
            f"{self.activation_checkpointing}; compile {self.compile}; micro_batch_size {self.micro_batch_size} x "
            f"{self.grad_accumulation_steps} per step; {self.seconds:.1f} s",
        ]
        head = ("rank", "mesh", "params", "grads", "optimizer", "activations", "peak", "checkpoint")
        body = [
            (
                str(r.rank),
                ",".join(f"{k}={v}" for k, v in r.coordinates.items()) or "-",
                _fmt(r.params),
                _fmt(r.grads),
                _fmt(r.optimizer),
                _fmt(r.activations),
                _fmt(r.peak),
                _fmt(r.checkpoint_bytes),
            )
            for r in self.ranks
        ]
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head, *body]]
        lines.append("collectives per step (bytes a rank moves; kind: mesh dimension):")
        for r in self.ranks:
            parts = [
                f"{kind} {dim} {_fmt(n)} ({r.calls[kind][dim]} calls)"
                for kind in KINDS
                for dim, n in sorted(r.collectives.get(kind, {}).items())
            ]
            lines.append(f"  rank {r.rank}: " + ("; ".join(parts) or "none"))
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _fmt(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# -- measuring ---------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def storage_bytes(tensors: Any) -> int:
    """Bytes of the storages behind ``tensors`` (DTensors: their local shards), each storage once."""
    seen: dict[int, int] = {}
    for t in tree_flatten(tensors)[0]:
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            seen[StorageWeakRef(storage).cdata] = storage.nbytes()
    return sum(seen.values())


def _held(engine: Engine) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, gradients, optimizer state) of this rank, as local tensors."""
    params: list[torch.Tensor] = list(engine.model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [
        v for s in (engine.optimizer.state.values() if engine.optimizer else ()) for v in s.values()
    ]  # Adam's moments and step counts
    return params, grads, [v for v in state if isinstance(v, torch.Tensor)]


def mesh_sizes(strategy: Any, world_size: int) -> dict[str, int]:
    """The strategy's mesh, outermost dimension first: a hybrid's own sizes, else the one dimension
    its ranks split (``dp_shard`` for FSDP, ``dp_replicate`` for DDP, ``tp``, ``pp``)."""
    dims = getattr(strategy, "resolved_dims", None)
    if dims is not None:
        return {
            "pp": dims.pp,
            "dp_replicate": dims.dp_replicate,
            "dp_shard": dims.dp_shard,
            **({"cp": dims.cp} if dims.cp > 1 else {}),  # named only when used (context parallelism)
            "tp": dims.tp,
        }
    one = {"zero2": "dp_shard", "zero3": "dp_shard", "fsdp": "dp_shard", "tp": "tp", "pp": "pp"}
    return {one.get(getattr(strategy, "name", ""), "dp_replicate"): world_size}


def _coordinates(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, size in reversed([(n, s) for n, s in sizes.items() if s > 1]):
        rank, out[name] = divmod(rank, size)
    return dict(reversed(list(out.items())))


def _checkpoint_plan(engine: Engine, is_coordinator: bool) -> tuple[int, int]:
    """(tensor bytes, entries) of this rank's local plan of a sharded save (DCP's default planner,
    as :func:`kiln.checkpoint.formats.dcp_writer_and_planner` makes it for ``save_type="sharded"``)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from kiln.planning.fake_world import real_tensors

    state = engine.strategy.state_dict(engine.model, engine.optimizer)
    planner = DefaultSavePlanner()
    with real_tensors():  # the planner computes each shard's offsets in small tensors it reads
        planner.set_up_planner(state, None, is_coordinator)
        plan = planner.create_local_plan()
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            total += math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
    return total, len(plan.items)


def _loss_of(engine: Engine) -> Any:
    """The Trainer's forward and loss of a microbatch (``Trainer._plain_loss``): a kiln.Model gets the
    batch; a plain module its inputs, and the criterion the targets."""
    from kiln.core.model import Model

    if isinstance(engine.module, Model):
        return lambda mb: engine.criterion(engine(mb), mb)
    return lambda mb: engine.criterion(engine(mb[0]), mb[1])


def measure_step(engine: Engine, microbatches: Sequence[Any], sizes: dict[str, int], rank: int) -> RankReport:
    """Run one training step of ``microbatches`` through ``engine`` and measure it (see the module
    docstring). Under a pipeline whose stages are not built yet, they are built and the schedule set
    up first, with no microbatch run."""
    from kiln.cost.activations import _LiveBytes

    loss_of = _loss_of(engine)
    pipeline = getattr(engine.strategy, "pipeline", None)
    if pipeline is not None and not pipeline.built:
        # builds the stages and sets up the schedule's buffers and neighbours, running no microbatch:
        # the step measured below is then a run's steady one
        with pipeline.setting_up():
            engine.train_step(microbatches, loss_of)
    params, grads, state = _held(engine)
    buffers = list(engine.model.buffers())
    tracker = _LiveBytes(
        [
            _local(t)
            for t in (*params, *grads, *state, *buffers, *tree_flatten(microbatches)[0])
            if isinstance(t, torch.Tensor)
        ]
    )
    counter = CollectiveCounter(sizes)
    marks: list[int] = []
    gc.collect()  # nothing of the setup is freed during the step, and the step's garbage goes when
    gc.disable()  # its last reference does (a collection at a random moment would move the peak)
    try:
        with tracker.watching_resizes(), tracker, counter:
            engine.train_step(microbatches, loss_of, after_microbatches=lambda _: marks.append(len(tracker.events)))
    finally:
        gc.enable()
    params, grads, state = _held(engine)

    def serials(tensors: list[torch.Tensor]) -> set[int]:
        keys = {StorageWeakRef(_local(t).untyped_storage()).cdata for t in tensors}
        return {tracker.live[k][2] for k in keys if k in tracker.live}

    p_bytes, o_bytes = storage_bytes(params), storage_bytes(state)
    grad_serials, state_serials = serials(grads), serials(state)
    activations = tracker.peak(exclude=grad_serials | state_serials, upto=marks[-1] if marks else None)
    peak = p_bytes + o_bytes + tracker.peak(exclude=state_serials)
    checkpoint_bytes, entries = _checkpoint_plan(engine, rank == 0)
    return RankReport(
        rank=rank,
        coordinates=_coordinates(rank, sizes),
        params=p_bytes,
        grads=storage_bytes(grads),
        optimizer=o_bytes,
        activations=activations,
        peak=peak,
        collectives=counter.bytes,
        calls=counter.calls,
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_entries=entries,
    )


# -- building the run ---------------------------------------------------------------------------------
def first_microbatch(args: TrainerArgs) -> Any:
    """The run's first microbatch: ``micro_batch_size`` samples of its training set, collated as its
    loader collates them (what every data-parallel rank's first forward gets, in shape)."""
    from torch.utils.data import default_collate

    from kiln.config.build import build_value, import_type

    data = args.dataset
    if data.type is None:
        raise ValueError("dataset.type: a dry run runs a microbatch of the training set; set dataset.type")
    dataset = import_type(data.type, "dataset.type")(**build_value(data.train_args, "dataset.train_args"))
    loader_args = build_value(args.dataloader.train_args, "dataloader.train_args")
    collate = loader_args.get("collate_fn") or default_collate
    if isinstance(collate, str):
        collate = import_type(collate, "dataloader.train_args.collate_fn")
    if isinstance(dataset, torch.utils.data.IterableDataset):
        samples = [sample for sample, _ in zip(dataset, range(args.micro_batch_size))]
    else:
        samples = [dataset[i] for i in range(min(args.micro_batch_size, len(dataset)))]
    return collate(samples)


class NotDryRunnable(ValueError):
    """The run's strategy cannot be dry-run (:data:`_REAL_STORAGE` says why)."""


# Strategies whose setup reads the parameters' storage, which fake tensors do not have.
_REAL_STORAGE = {
    "ddp": "DistributedDataParallel checks and buckets the parameters' data in C++",
    "zero1": "it runs on DistributedDataParallel, which checks and buckets the parameters' data in C++",
    "deepspeed": "DeepSpeed's engine allocates and copies real buffers",
    "auto": "auto chooses by this machine's memory, not the cluster's; set the strategy it should pick",
}


@contextlib.contextmanager
def _engine(args: TrainerArgs, world_size: int, rank: int) -> Iterator[tuple[Engine, int]]:
    """The Engine (and the model's number of parameters) a run of ``args`` builds on ``rank`` of ``world_size``, in a fake world, on a model
    built on the meta device (the Trainer's own :func:`kiln.trainer.building.build_engine`, with the
    config CLI's model, optimizer, strategy and lever builders)."""
    from kiln.config.build import build_value, import_type

    # the config CLI's own builders, so the dry run builds what kiln train builds
    from kiln.config.trainer_builder import _activation_checkpointing, _model, _strategy, build_precision
    from kiln.parallel.strategy import get_strategy
    from kiln.planning.fake_world import fake_world
    from kiln.trainer.building import build_engine
    from kiln.trainer.options import LeverOptions

    # Built before the fake world: placement turns these real meta parameters into fake ones on the
    # device; parameters made fake already could not be moved (nn.Module.to swaps fake parameters).
    with torch.device("meta"):
        model, criterion, _ = _model(args)
    num_parameters = sum(p.numel() for p in model.parameters())
    optimizer = import_type(args.optimizer.type, "optimizer.type")(
        model.parameters(), **build_value(args.optimizer.args, "optimizer.args")
    )
    levers = LeverOptions(
        compile=False,  # skipped: see the module docstring
        activation_checkpointing=_activation_checkpointing(args.activation_checkpointing),
        float8=args.float8,
    )
    with fake_world(world_size, rank) as ctx:
        strategy = get_strategy(_strategy(args, ctx), ctx)
        if strategy.name in _REAL_STORAGE:
            raise NotDryRunnable(
                f"compute_config.strategy: {strategy.name!r} cannot be dry-run: {_REAL_STORAGE[strategy.name]}; "
                "dry-run the run with strategy fsdp (or a hybrid mesh), or see its memory with kiln plan "
                "(no --dry-run)"
            )
        engine = build_engine(
            model,
            optimizer,
            criterion,
            precision=build_precision(args.precision),
            strategy=strategy,
            clip_grad_norm=args.optimizer.clip_gnorm or None,
            levers=levers,
            deepspeed_config=None,
            algorithms=(),
            ctx=ctx,
        )
        yield engine, num_parameters


def check_plan(args: TrainerArgs, world_size: int) -> None:
    """The configuration checks of a dry run without its step, for ``kiln train`` to make before any
    worker starts: rank 0's model (on the meta device: no weights), strategy and Engine are built in
    a fake world of ``world_size``, so a mesh that does not fit the world, a ``tp`` that does not
    divide the heads or key/value heads, an ``ep`` that does not divide the experts, a pipeline split
    or schedule that cannot run are refused with the message the real run (and ``kiln plan
    --dry-run``) gives. A strategy that cannot be dry-run (ddp, zero1, deepspeed, auto) is left to
    the run, whose own checks come first there too.

    Raises:
        ValueError, TypeError: a configuration error, in one line.
    """
    try:
        with _engine(args, world_size, 0):
            pass
    except NotDryRunnable:
        return


def dry_run_rank(args: TrainerArgs, world_size: int, rank: int, microbatch: Any) -> tuple[RankReport, Engine, int]:
    """The step of ``rank`` (:func:`measure_step`), the Engine it ran in (its fake world is gone) and
    the model's number of parameters."""
    with _engine(args, world_size, rank) as (engine, num_parameters):
        microbatches = [microbatch] * (args.grad_accumulation_steps or 1)
        return measure_step(engine, microbatches, mesh_sizes(engine.strategy, world_size), rank), engine, num_parameters


@dataclass(frozen=True)
class _Run:
    """What the report says of the run, the same from every rank (plain values: a worker sends it)."""

    strategy: str
    precision: str
    mesh: dict[str, int]
    num_parameters: int

    @staticmethod
    def of(engine: Engine, world_size: int, num_parameters: int) -> _Run:
        return _Run(
            repr(engine.strategy), engine.precision.name, mesh_sizes(engine.strategy, world_size), num_parameters
        )


def _up_to_the_cut(
    args: TrainerArgs, world_size: int, rank: int, microbatch: Any, traces: SharedTraces
) -> tuple[RankReport | None, _Run]:
    """Rank ``rank``'s dry run (:func:`dry_run_rank`), stopped once a pipeline has cut the model (the
    cut kept for the ranks measured after: :meth:`SharedTraces.cut_only`; no report then)."""
    with _engine(args, world_size, rank) as (engine, num_parameters):
        run = _Run.of(engine, world_size, num_parameters)
        microbatches = [microbatch] * (args.grad_accumulation_steps or 1)
        try:
            with traces.cut_only():
                return measure_step(engine, microbatches, run.mesh, rank), run
        except CutOnly:
            return None, run


def dry_run(
    args: TrainerArgs,
    world_size: int,
    *,
    ranks: Sequence[int] | None = None,
    microbatch: Any = None,
    workers: int | None = None,
) -> DryRunReport:
    """Dry-run ``args`` (resolved for ``world_size``: :func:`kiln.config.load_trainer_args`) as
    ``ranks`` of a world of ``world_size`` (default: the first rank of each pipeline stage).

    Args:
        args: the run's resolved ``TrainerArgs``.
        world_size: the ranks of the run.
        ranks: the ranks to measure.
        microbatch: the batch each rank's step runs (default: :func:`first_microbatch`).
        workers: processes measuring ranks at once (:mod:`kiln.planning.rank_workers`; default:
            one per CPU this process may use). With more than 1, a pipeline's first rank is run here
            up to the cut into stages, and every rank is then measured in a worker over that cut; 1:
            one after another in this process.

    Raises:
        ValueError: a configuration error, with the message the real run gives.

    Example::

        report = dry_run(load_trainer_args("run.yaml", world_size=512), 512)
        print(report.format())
    """
    start = time.perf_counter()
    if microbatch is None:
        microbatch = first_microbatch(args)
    workers = default_workers() if workers is None else workers
    todo = list(ranks) if ranks is not None else [0]
    reports: dict[int, RankReport] = {}
    with one_trace() as traces:  # a pipeline's ranks share the first one's trace and cut of the model
        first = todo[0]
        if workers > 1 and can_fork():
            # Side by side: the first rank runs here up to a pipeline's cut, which every worker
            # inherits, and all the ranks are measured in the workers. Without a pipeline, the first
            # rank's whole dry run is here.
            report, run = _up_to_the_cut(args, world_size, first, microbatch, traces)
        else:
            report, engine, num_parameters = dry_run_rank(args, world_size, first, microbatch)
            run = _Run.of(engine, world_size, num_parameters)
        if report is not None:
            reports[todo.pop(0)] = report
        if ranks is None:  # now the mesh is known: the first rank of every other stage
            todo += [stage * world_size // run.mesh.get("pp", 1) for stage in range(1, run.mesh.get("pp", 1))]

        def measure(rank: int) -> RankReport:
            return dry_run_rank(args, world_size, rank, microbatch)[0]

        reports.update(measure_ranks(measure, todo, workers))
    notes = []
    if args.compile:
        notes.append(
            "compile is on in the run and skipped here: compiled blocks fuse element-wise ops, so the "
            "real activations may be smaller than measured"
        )
    return DryRunReport(
        world_size=world_size,
        mesh=run.mesh,
        strategy=run.strategy,
        precision=run.precision,
        activation_checkpointing=None if args.activation_checkpointing is None else str(args.activation_checkpointing),
        compile="skipped" if args.compile else "off",
        micro_batch_size=args.micro_batch_size,
        grad_accumulation_steps=args.grad_accumulation_steps or 1,
        num_parameters=run.num_parameters,
        ranks=[reports[r] for r in sorted(reports)],
        seconds=time.perf_counter() - start,
        notes=notes,
    )
