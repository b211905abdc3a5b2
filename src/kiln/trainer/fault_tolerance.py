"""Replica fault tolerance on torchft: a job of replica groups that outlives the death of any one.

Each replica group is its own launch (``kiln run``, SLURM, or a single process) with any strategy
inside it; torchft's Lighthouse (``kiln lighthouse``) forms a *quorum* of the groups that are alive
and its Manager, one per group, runs each step through it. Per step, in the Trainer's loop:

1. before the step's batch is fetched (``BEFORE_DATALOADER``; the first time at ``FIT_START``,
   before the loader is iterated): ``manager.start_quorum()``, synchronously. A group that is behind
   (a restarted one, or one that did not commit the last step) receives the weights, optimizer and
   kiln training state (timestamp, data position, RNG, schedulers, callbacks: the per-rank state a
   checkpoint holds, :func:`kiln.checkpoint.state.collect_training_state`) from a live peer over
   torchft's checkpoint transport, and loads them here, before it reads a batch;
2. on the complete gradients, before clipping (the Engine's ``gradient_sync`` hook): the
   gradients are averaged over the groups of the quorum with ``manager.allreduce`` (after the
   group's own data parallelism averaged them inside the group), then ``manager.should_commit()``
   says whether every group got through; only then does the optimizer step. A step that does not
   commit changes no weights; its batch is skipped, as in torchft.

Groups read disjoint shares of the data (``num_replica_groups`` x the group's data-parallel size);
a dead group's share is not read while it is away. The Timestamp counts this group's samples.
Checkpoints are written by one group (``save_group``); any group resumes from them.

What torchft leaves to the caller and kiln chooses here: the quorum is synchronous
(``use_async_quorum=False``) so that a healed group never trains a step on stale weights, and the
cross-group process group follows the device the group trains on (:func:`process_group_class`):
torchft's ``ProcessGroupNCCL`` for CUDA, so the gradients go GPU to GPU (an 8B model's are 32 GB a
step: staged through host memory over gloo they would cost more than the step), and
``ProcessGroupGloo`` for CPU tensors. The reconfiguration on a new quorum is torchft's.

When the groups of the quorum change, group rank 0 of each group prints one line
(``kiln: replica group 1 left the quorum at step 5; continuing with 1 of 2 groups``, ``... rejoined
...``); torchft's own messages about it go to kiln's DEBUG log (:mod:`kiln.trainer.ft_quiet`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from kiln.core.callback import Callback
from kiln.core.names import did_you_mean
from kiln.launch.failures import print_line
from kiln.trainer.ft_quiet import membership_lines, quiet_checkpoint_server, quiet_torchft

if TYPE_CHECKING:
    from kiln.core.state import State
    from kiln.engine import Engine

__all__ = ["FaultTolerance", "ReplicaGroup", "as_fault_tolerance", "process_group_class"]


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """How this replica group joins the others (``Trainer(fault_tolerance=...)``, YAML ``fault_tolerance:``).

    Args:
        lighthouse: the Lighthouse's address, ``http://host:port`` (None: ``$TORCHFT_LIGHTHOUSE``).
        replica_group: this group's index, 0 to ``num_replica_groups - 1`` (None: ``$REPLICA_GROUP_ID``).
        num_replica_groups: how many groups the job is planned with; the data is split into that
            many shares (None: ``$NUM_REPLICA_GROUPS``).
        min_replicas: the fewest groups a step commits with.
        timeout: seconds for a cross-group collective, ``should_commit`` and a recovery transfer; a
            hung group stalls the others at most this long before it is dropped from the quorum.
        quorum_timeout: seconds to wait for a quorum (longer than a step: a group waits for the others).
        connect_timeout: seconds to reach the Lighthouse and the other groups' managers.
        save_group: the group that writes checkpoints (the others do not; any group loads them).
        hostname: the address the other groups reach this group at (None: this host's name).

    Example::

        trainer = kiln.Trainer(model, ..., fault_tolerance={"lighthouse": "http://node0:29510",
                                                            "replica_group": 1, "num_replica_groups": 2})
    """

    lighthouse: str | None = None
    replica_group: int | None = None
    num_replica_groups: int | None = None
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 60.0
    save_group: int = 0
    hostname: str | None = None

    def __post_init__(self) -> None:
        env = {
            "lighthouse": "TORCHFT_LIGHTHOUSE",
            "replica_group": "REPLICA_GROUP_ID",
            "num_replica_groups": "NUM_REPLICA_GROUPS",
        }
        for name, var in env.items():  # the variables torchft's own launchers set
            if getattr(self, name) is None and os.environ.get(var):
                value: Any = os.environ[var]
                if name != "lighthouse":
                    try:
                        value = int(value)
                    except ValueError:
                        raise ValueError(f"${var}={value!r} is not an integer; set it to this group's index") from None
                object.__setattr__(self, name, value)
            if getattr(self, name) is None:
                raise ValueError(f"fault_tolerance.{name} is not set; pass it, or set ${var}")
        if not str(self.lighthouse).startswith(("http://", "https://")):
            raise ValueError(
                f"fault_tolerance.lighthouse={self.lighthouse!r} is not an address; expected http://host:port "
                "(what `kiln lighthouse` prints)"
            )
        for name in ("num_replica_groups", "min_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"fault_tolerance.{name}={value!r} must be an int >= 1")
        groups = self.num_replica_groups
        assert groups is not None  # set above
        for name in ("replica_group", "save_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < groups:
                raise ValueError(
                    f"fault_tolerance.{name}={value!r} must be an int from 0 to num_replica_groups - 1 = {groups - 1}"
                )
        if self.min_replicas > groups:
            raise ValueError(
                f"fault_tolerance.min_replicas={self.min_replicas} exceeds num_replica_groups={groups}: no step "
                "could ever commit; lower min_replicas"
            )
        for name in ("timeout", "quorum_timeout", "connect_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"fault_tolerance.{name}={value!r} must be a positive number of seconds")

    def data_shard(self, size: int, rank: int) -> tuple[int, int]:
        """The share of the data that data-parallel rank ``rank`` of ``size`` in this group reads, across
        every group: (number of shares, index). The Trainer's sampler and the config CLI's use it."""
        groups, group = self.num_replica_groups, self.replica_group
        assert groups is not None and group is not None  # __post_init__ set them
        return size * groups, group * size + rank


def as_fault_tolerance(value: FaultTolerance | Mapping[str, Any] | None) -> FaultTolerance | None:
    """The Trainer's ``fault_tolerance=``: None, a :class:`FaultTolerance`, or a dict of its fields."""
    if value is None or isinstance(value, FaultTolerance):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(
            f"fault_tolerance={value!r} is a {type(value).__name__}; expected a dict or kiln.trainer.FaultTolerance"
        )
    known = [f.name for f in fields(FaultTolerance)]
    for key in value:
        if key not in known:
            raise ValueError(
                f"fault_tolerance has an unknown key {key!r}{did_you_mean(key, known)}; expected some of {known}"
            )
    return FaultTolerance(**value)


class ReplicaGroup(Callback):
    """This replica group's torchft Manager, run by the Trainer's loop (see the module docstring).

    Built by the Trainer from its ``fault_tolerance=`` option; ``trainer.fault_tolerance`` is this
    object. It counts ``num_attempted`` and ``num_committed`` steps, keeps ``num_participants`` (the
    groups in the last quorum) and ``quorum_seconds`` (time spent waiting for quorums, where a dead
    group's cost shows); its ``state_dict`` (the Manager's step) goes into checkpoints.
    """

    def __init__(self, options: FaultTolerance, state: State, engine: Engine) -> None:
        # torchft's Rust manager logs several INFO lines a step (quorum, should_commit) to stderr,
        # which bury kiln's progress lines in a log file: warnings only, unless RUST_LOG says otherwise.
        os.environ.setdefault("RUST_LOG", "warn")
        try:
            from torchft import Manager
            from torchft.checkpointing.http_transport import HTTPTransport
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"fault_tolerance= needs torchft ({exc}); install it with: pip install 'kiln-train[ft]'"
            ) from exc
        self.options = options
        self.state, self.engine = state, engine
        assert options.replica_group is not None  # FaultTolerance set it, from $REPLICA_GROUP_ID if need be
        self.group: int = options.replica_group
        self.num_attempted = self.num_committed = 0
        self.num_participants = 0
        self.quorum_seconds = 0.0
        self._open = False  # a quorum is started and its step not yet committed
        self._groups: tuple[int, ...] | None = None  # the replica groups of the last quorum
        self._seen: set[int] = set()
        self._healed = False  # this group took a live group's state in the last quorum
        ctx = engine.ctx
        hostname = options.hostname or socket.gethostname()
        # The group's own TCPStore, new with each start of the group, on group rank 0 at ``hostname``
        # (the other groups reach it there to build the cross-group process group). Not torchrun's
        # (MASTER_ADDR/PORT): that one outlives an elastic restart and still holds the dead rank 0's
        # manager address, which the restarted ranks read before the new rank 0 writes its own.
        if ctx.world_size > 1 and not torch.distributed.is_initialized():
            raise RuntimeError(
                "fault_tolerance= with a group of several processes needs the group's process group: run the "
                "group with `kiln run` (torchrun) or another kiln launcher"
            )
        self._store: Any = None
        where: list[Any] = [None, None]
        if ctx.rank == 0:
            self._store = torch.distributed.TCPStore(hostname, 0, is_master=True, wait_for_workers=False)
            where = [hostname, self._store.port]
        if ctx.world_size > 1:
            torch.distributed.broadcast_object_list(where, src=0)
        store_addr, store_port = where
        seconds = timedelta(seconds=options.timeout)
        pg_class = process_group_class(ctx.device)
        nccl = pg_class.__name__ == "ProcessGroupNCCL"
        if nccl:
            # torchft's NCCL group is non-blocking and warns, then sets this to its timeout, when unset.
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(options.timeout))
        quiet_torchft(nccl=nccl)
        self._pg = _recording(pg_class)(timeout=seconds)
        transport: Any = HTTPTransport(timeout=seconds, num_chunks=0)  # torchft's default, made here to quiet it
        quiet_checkpoint_server(transport)
        self.manager = Manager(
            pg=self._pg,
            checkpoint_transport=transport,
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=options.min_replicas,
            use_async_quorum=False,
            timeout=seconds,
            quorum_timeout=timedelta(seconds=options.quorum_timeout),
            connect_timeout=timedelta(seconds=options.connect_timeout),
            rank=ctx.rank,
            world_size=ctx.world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=options.lighthouse,
            replica_id=f"kiln_group_{self.group}",
            hostname=hostname,
        )
        engine.set_gradient_sync(self.sync_gradients)

    # -- the per-step protocol ---------------------------------------------------------------------
    def start_quorum(self) -> None:
        """Join this step's quorum (once per step); a group behind the others heals here."""
        if self._open:
            return
        start = time.perf_counter()
        self.manager.start_quorum()
        self.quorum_seconds += time.perf_counter() - start
        self.num_participants = self.manager.num_participants()
        self._open = True
        self._report_membership()

    def _report_membership(self) -> None:
        """kiln's line when the quorum's groups changed (group rank 0 only)."""
        groups = self._pg.groups  # set by torchft at each new quorum, before start_quorum returns
        step = self.state.timestamp.batch.value + 1  # the step this quorum is for
        lines = []
        if self._healed and step > 1:  # at step 1 it is torchft's first sync of the weights, not a recovery
            lines.append(f"replica group {self.group} took the live groups' state at step {step}")
        self._healed = False
        if groups is not None and groups != self._groups:
            before, self._groups = self._groups, groups
            total = self.options.num_replica_groups
            assert total is not None  # FaultTolerance set it
            lines += membership_lines(before, groups, step=step, num_groups=total, seen=self._seen)
        if self.engine.ctx.rank == 0:
            for line in lines:
                print_line(f"kiln: {line}")

    def sync_gradients(self) -> bool:
        """Average the gradients over the quorum's groups; True when every group commits this step."""
        self.start_quorum()  # an Engine driven outside fit() has no quorum yet
        manager = self.manager
        params = [p for p in _parameters(self.engine.optimizer) if p.requires_grad]
        for p in params:
            if p.grad is None:  # unused in this group's batch: it adds zeros, and steps as the others do
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if grads:
            # One flat buffer per dtype: one allreduce instead of one per tensor.
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for grad in grads:
                by_dtype.setdefault(grad.dtype, []).append(grad)
            pending = []
            for group in by_dtype.values():
                flat = torch.cat([g.reshape(-1) for g in group])
                pending.append((group, flat, manager.allreduce(flat)))  # averaged over the participants
            for group, flat, work in pending:
                work.wait()  # an error is recorded by the Manager and turns should_commit False
                offset = 0
                for grad in group:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
        self.num_attempted += 1
        self._open = False
        committed = manager.should_commit()
        self.num_committed += int(committed)
        return committed

    # -- the loop's events -------------------------------------------------------------------------
    def fit_start(self, state: State, logger: Any) -> None:
        # Before the loop iterates the loader: a restarted group takes a peer's data position here.
        self.start_quorum()

    def before_dataloader(self, state: State, logger: Any) -> None:
        self.start_quorum()

    def close(self, state: State, logger: Any) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the Manager's servers (the Lighthouse then drops this group at its next quorum)."""
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=False)

    # -- what a healing group receives -------------------------------------------------------------
    def _peer_state(self) -> dict[str, Any]:
        from kiln.checkpoint.state import collect_training_state, model_optimizer_state

        return {"tensors": model_optimizer_state(self.state), "training": collect_training_state(self.state)}

    def _load_peer_state(self, saved: Mapping[str, Any]) -> None:
        from kiln.checkpoint.state import load_model_optimizer_state, restore_training_state

        load_model_optimizer_state(self.state, saved["tensors"])
        restore_training_state(self.state, saved["training"], source="the state from a live replica group")
        self._healed = True

    # -- checkpoints ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return dict(self.manager.state_dict()) if self.manager is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and self.manager is not None:
            self.manager.load_state_dict(state)

    @property
    def writes_checkpoints(self) -> bool:
        return self.group == self.options.save_group

    def data_shard(self, size: int, rank: int) -> tuple[int, int]:
        """This rank's share of the data across every group: (number of shares, index)."""
        return self.options.data_shard(size, rank)


def process_group_class(device: torch.device | str) -> type:
    """torchft's process group for the cross-group gradient average of groups that train on ``device``:
    ``ProcessGroupNCCL`` for CUDA (the gradients stay on the GPUs; NCCL needs them there) and
    ``ProcessGroupGloo`` otherwise (CPU tensors). torchft's in-process NCCL group, not its "baby"
    variant, which runs NCCL in a subprocess with a CUDA context of its own (about 1 GB more per
    GPU, kernels time-shared with the step's)."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    return ProcessGroupNCCL if torch.device(device).type == "cuda" else ProcessGroupGloo


def _recording(pg_class: type) -> type:
    """``pg_class`` that also keeps ``groups``: the replica groups of the quorum it was last
    configured for (torchft reconfigures it at each new quorum with the global ranks in it,
    ``replica group x group size + group rank``; kiln names the groups ``kiln_group_<index>``)."""

    class Recording(pg_class):
        groups: tuple[int, ...] | None = None

        def configure(
            self,
            store_addr: str,
            replica_id: str,
            rank: int,
            world_size: int,
            quorum_id: int | None = None,
            group_rank: int | None = None,
            group_world_size: int | None = None,
            global_ranks: list[int] | None = None,
        ) -> None:
            if global_ranks and group_world_size:
                self.groups = tuple(sorted({r // group_world_size for r in global_ranks}))
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )

    Recording.__name__ = Recording.__qualname__ = f"Recording{pg_class.__name__}"
    return Recording


def _parameters(optimizer: Any) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [p for group in optimizer.param_groups for p in group["params"]]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (the same rank of every group holds the
    same shard, and torchft's process group pairs those ranks)."""
    from torch.distributed.tensor import DTensor

    return grad._local_tensor if isinstance(grad, DTensor) else grad
