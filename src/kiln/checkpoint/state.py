"""What a checkpoint holds, taken from and put back into a kiln ``State`` (and its Engine).

Two parts, because they are stored differently:

- model and optimizer tensors, through the strategy's ``state_dict``/``load_state_dict``: for
  torch's own strategies ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict``/
  ``set_state_dict``, which speak plain modules, DDP, FSDP2 and DTensor alike and key the optimizer
  state by parameter name (so it survives a change of world size);
- the *training state* of each rank, small and stored per rank: timestamp, schedulers, grad scaler,
  the Engine's accumulation counter, RNG states (python, numpy, torch, cuda), the training loader's
  position (a :class:`kiln.launch.ResumableLoader`'s ``state_dict``), and callback and algorithm
  ``state_dict``\\ s.

Bit-exact resume needs one more thing: ``DataLoader.__iter__`` draws a seed from torch's global RNG.
An uninterrupted run drew it at the start of the epoch, before the RNG state a mid-epoch checkpoint
recorded; a resumed run draws it after restoring that state. A load hands the restored RNG states to
the loader with its position, and the loader's first ``iter()`` puts them back.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from kiln.checkpoint.errors import CheckpointError
from kiln.checkpoint.serialization import check_loadable
from kiln.core.warn import KilnWarning
from kiln.launch.loader import ResumableLoader
from kiln.launch.rng import rng_state, set_rng_state

__all__ = [
    "training_objects",
    "model_optimizer_state",
    "load_model_optimizer_state",
    "collect_training_state",
    "serialize_training_state",
    "restore_training_state",
    "run_config",
]


# -- model and optimizer ------------------------------------------------------------------------
def training_objects(state: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """The model as the strategy wrapped it, and the optimizer that steps it."""
    engine = getattr(state, "engine", None)
    optimizer = getattr(engine, "optimizer", None) if engine is not None else None
    if optimizer is None:
        optimizer = state.optimizers[0] if state.optimizers else None
    return (engine.model if engine is not None else state.model), optimizer


def model_optimizer_state(state: Any, full: bool = False, with_optimizer: bool | None = None) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}`` keyed by parameter name (``kiln.parallel.state.dcp_state``'s
    form, which knows DDP, FSDP2, ZeRO-1 and DTensor); shards stay shards unless ``full``.

    ``with_optimizer``: None saves the optimizer once it has stepped; True always includes it (a
    load target, which a checkpoint's values then overwrite).
    """
    model, optimizer = training_objects(state)
    strategy = _strategy(state)
    if optimizer is not None and (with_optimizer or (with_optimizer is None and _has_stepped(optimizer))):
        return strategy.state_dict(model, optimizer, full=full)
    # DCP would "initialise" a fresh optimizer by stepping it with zero gradients, leaving Adam's
    # step count at 1 and changing the run. A fresh optimizer has nothing to save.
    return strategy.state_dict(model, None, full=full)


def _strategy(state: Any) -> Any:
    """The Engine's strategy, which knows how its model and optimizer are laid out."""
    strategy = getattr(getattr(state, "engine", None), "strategy", None)
    if strategy is None:
        from kiln.parallel.strategy import Strategy

        strategy = Strategy()
    return strategy


def _has_stepped(optimizer: torch.optim.Optimizer) -> bool:
    """State exists, or gradients do (then DCP leaves the optimizer alone; stateless SGD lands here)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps state in .optim
    return (
        bool(inner.state)
        or bool(optimizer.state)
        or any(p.grad is not None for g in optimizer.param_groups for p in g["params"])
    )


def load_model_optimizer_state(state: Any, saved: Mapping[str, Any], strict: bool = True) -> None:
    model, optimizer = training_objects(state)
    if saved.get("optimizer") is None:
        saved = {"model": saved["model"]}
    _strategy(state).load_state_dict(model, optimizer, dict(saved), strict=strict)


# -- the per-rank training state ----------------------------------------------------------------
def _keyed(objects: list[Any]) -> dict[str, Any]:
    """Objects by class name, ``Name#1`` for the second of a class: stable when others are added."""
    seen: Counter[str] = Counter()
    keyed = {}
    for obj in objects:
        name = type(obj).__name__
        keyed[name if not seen[name] else f"{name}#{seen[name]}"] = obj
        seen[name] += 1
    return keyed


def collect_training_state(state: Any) -> dict[str, Any]:
    engine = getattr(state, "engine", None)
    if engine is not None and bool(getattr(engine, "micro_step", 0)):
        warnings.warn(
            f"checkpoint taken after micro-step {engine.micro_step} of {engine.gradient_accumulation}: the "
            "gradients accumulated so far are not saved, so a resume redoes this optimizer step without "
            "them; save at accumulation boundaries (after engine.step() returned True)",
            KilnWarning,
            stacklevel=4,
        )
    scaler = getattr(engine, "scaler", None)
    loader = getattr(state, "dataloader", None)
    return {
        "rank": state.rank,
        "world_size": state.world_size,
        "timestamp": state.timestamp.state_dict(),
        "schedulers": [s.state_dict() for s in state.schedulers],
        "scaler": scaler.state_dict() if scaler is not None else None,
        "engine": {"micro_step": int(getattr(engine, "micro_step", 0))} if engine is not None else None,
        "rng": rng_state(),
        "dataloader": _loader_position(loader),
        "callbacks": {k: cb.state_dict() for k, cb in _keyed(state.callbacks).items()},
        "algorithms": {k: alg.state_dict() for k, alg in _keyed(state.algorithms).items()},
    }


def serialize_training_state(state: Any) -> bytes:
    """The training state as ``torch.save`` bytes; refuses (naming the owner) what ``weights_only`` cannot load."""
    collected = collect_training_state(state)
    for kind in ("callbacks", "algorithms"):
        for key, value in collected[kind].items():
            check_loadable(value, f"<{kind[:-1]} {key}.state_dict()>")
    for index, value in enumerate(collected["schedulers"]):
        check_loadable(value, f"<scheduler {index} ({type(state.schedulers[index]).__name__}).state_dict()>")
    return check_loadable(collected, "<training state>")


def restore_training_state(
    state: Any, saved: Mapping[str, Any], source: str, restore_rng: bool = True, same_world: bool = True
) -> None:
    """Put a rank's saved training state back; ``source`` names the file in errors. ``same_world``:
    the checkpoint was saved by as many ranks as load it (for a checkpoint without the loader's own
    position: else the epoch is re-dealt from the Timestamp's samples)."""
    try:
        state.timestamp.load_state_dict(saved["timestamp"])
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(source, f"has an unreadable timestamp ({exc})") from None
    if len(saved["schedulers"]) != len(state.schedulers):
        raise CheckpointError(
            source,
            f"holds {len(saved['schedulers'])} LR scheduler(s) and the run has {len(state.schedulers)}",
            "build the run with the same schedulers it was saved with",
        )
    for scheduler, sd in zip(state.schedulers, saved["schedulers"]):
        scheduler.load_state_dict(sd)
    engine = getattr(state, "engine", None)
    scaler = getattr(engine, "scaler", None)
    if scaler is not None and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    if engine is not None and saved.get("engine"):
        engine.micro_step = int(saved["engine"]["micro_step"])
    for kind in ("callbacks", "algorithms"):
        stored = saved.get(kind) or {}
        for key, obj in _keyed(getattr(state, kind)).items():
            if key in stored:
                obj.load_state_dict(stored[key])
            elif type(obj).state_dict is not _base_state_dict(kind):
                warnings.warn(
                    f"{source} has no state for {kind[:-1]} {key}; it starts fresh", KilnWarning, stacklevel=3
                )
    if restore_rng:
        set_rng_state(saved["rng"])
    _restore_loader(state, saved, restore_rng, same_world)


def _base_state_dict(kind: str) -> Any:
    from kiln.core.callback import Algorithm, Callback

    return (Callback if kind == "callbacks" else Algorithm).state_dict


# -- resuming the data stream -------------------------------------------------------------------
def _loader_position(loader: Any) -> dict[str, Any] | None:
    if not isinstance(loader, ResumableLoader):
        return None
    position = loader.state_dict()
    # Mid-epoch its "rng" is rng_state() of this same moment: the checkpoint's "rng", stored once.
    position.pop("rng")
    return position


def _restore_loader(state: Any, saved: Mapping[str, Any], restore_rng: bool, same_world: bool) -> None:
    """Hand the saved position to ``state.dataloader``, which continues from it at its next ``iter()``.

    A loader that is not a ResumableLoader is wrapped in one, and a State without a loader gets one
    that holds the position for the loader to come (the Trainer's ``fit(train_dataloader=...)``).
    """
    position = saved.get("dataloader")
    if position is None:
        position = _position_from_timestamp(state, saved, same_world)
    # The RNG states to put back after iter() are those just restored (and checked doing so); none
    # when they were not this rank's to restore (another world size).
    position = {**position, "rng": saved["rng"] if restore_rng else None}
    loader = getattr(state, "dataloader", None)
    if not isinstance(loader, ResumableLoader):
        state.dataloader = loader = ResumableLoader(loader)
    loader.load_state_dict(position)


def _position_from_timestamp(state: Any, saved: Mapping[str, Any], same_world: bool) -> dict[str, Any]:
    """The loader position of a checkpoint written before the loader saved its own (or of a loader
    that was not a ResumableLoader): the Timestamp's, with the sampler state saved beside it."""
    ts = state.timestamp  # already restored
    return {
        "epoch": ts.epoch.value,
        "batch_in_epoch": ts.batch_in_epoch.value,
        # On the world size that saved it, each rank skips its own full batches (None: counted
        # from them; a hand-written loop's Timestamp may count one rank's samples). On another,
        # the Trainer's Timestamp counts every rank's samples: the start of the epoch's order.
        "sample_in_epoch": None if same_world else ts.sample_in_epoch.value,
        "sampler": saved.get("sampler"),
    }


def run_config(state: Any) -> Any:
    """The run's configuration, for the manifest: ``state.config``, else the launch context's."""
    config = getattr(state, "config", None)
    if not config:
        from kiln.launch.context import context

        config = context().config
    return dict(config) if isinstance(config, Mapping) else config
