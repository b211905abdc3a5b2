"""Activation memory of one microbatch, measured on fake tensors: what ``auto`` and ``kiln plan`` add
to the parameters, gradients and optimizer state of each rank.

:func:`estimate_activations` runs one forward and backward of the model on the example
microbatch under torch's ``FakeTensorMode``: every tensor has its shape, dtype and device but no
storage, so a model of any size costs a Python call per op and no memory. The parameters and
buffers go in as fake stand-ins for the run (torch.func.functional_call's reparametrization): the model, its gradients,
its buffers (batch-norm statistics) and the random number generators stay as they were. A model
whose forward reads tensor values (data-dependent control flow) cannot run on fake tensors; it is
then run once on real tensors (``method="real tensors"``), with the same care: the parameters
are used through detached aliases, buffers through copies, and the RNG state is restored.

Counted: the bytes of every tensor storage alive during that forward and backward (a storage
counts once, whatever its views), the peak over the run less the parameters' gradients (the plan
counts those in its own column). That is what autograd saves for the backward, plus the outputs
the loop keeps (the Trainer holds ``state.outputs`` through the backward), plus the backward's
temporaries (the gradient of each activation coexists with the saved tensors it consumes). A
tensor subclass that wraps others (a DTensor under tensor parallelism) holds no memory of its own:
its inner tensors are counted, made by ops this count does not see one by one (DTensor runs its
local ops inside the op this mode sees).

Activation checkpointing is measured, not modelled: the modules ``activation_checkpointing``
names get ``torch.utils.checkpoint`` (non-reentrant, as kiln applies it) for the fake run, so the
count sees what the real run keeps: each checkpointed block's inputs, and one block's internals
while the backward recomputes it.

Against real runs on the CPU (live tensor bytes from the profiler's memory timeline), the
estimate is within a few percent for the tiny Llama and the digits CNN, with and without
checkpointing (``tests/test_activation_estimate.py`` prints both). Kernels that save other
tensors on other devices (flash attention on CUDA) move the real number a little.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["ActivationEstimate", "estimate_activations", "checkpointed_modules"]


@dataclass(frozen=True)
class ActivationEstimate:
    """One microbatch's activation memory.

    Args:
        peak: the most bytes alive at once during the forward and backward, less the parameters'
            gradients: what a rank needs for activations on top of parameters, gradients and state.
        saved: the bytes autograd holds for the backward when the forward ends.
        activation_checkpointing: the mode measured (None: without checkpointing).
        method: ``"fake tensors"`` or ``"real tensors"`` (a forward that reads tensor values).
    """

    peak: int
    saved: int
    activation_checkpointing: Any = None
    method: str = "fake tensors"


def _plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``'s memory: ``t``, or the inner tensors of a wrapper subclass
    (a DTensor's local shard), which own the storages."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, name) for name in names]
    return [p for x in inner if isinstance(x, torch.Tensor) for p in _plain(x)]


def _key(t: torch.Tensor) -> int:
    """What identifies a plain tensor ``t``'s storage while it lives."""
    return StorageWeakRef(t.untyped_storage()).cdata


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages the ops create, over time: each op's new outputs, and each
    storage freed, as it is freed (a weak reference's callback: torch keeps one Python object per
    storage while the storage lives). The storages of ``baseline`` (parameters, buffers, the input)
    exist before and are never counted, nor are their views (a transposed weight)."""

    def __init__(self, baseline: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int, int]] = {}  # storage -> (ref, bytes, serial)
        self.events: list[tuple[int, int]] = []  # (serial, +bytes / -bytes), in order
        self._serial = 0
        self._baseline = {_key(p) for t in baseline for p in _plain(t)}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, an in-place op, a collective into its buffer)
        # allocated nothing: its storage is counted where it was made, or made before the count began.
        # A DTensor op runs its local ops inside this call, with this mode off: they are never seen
        # one by one, so its output's local shard is counted here (and a DTensor input's shard is an
        # input's storage). Counting only plain tensors missed every tensor-parallel activation made
        # inside DTensor ops: the sequence-parallel residual stream and norms, the projections'
        # outputs, the vocabulary-sharded logits and the loss's log-softmax.
        inputs = {_key(p) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) for p in _plain(t)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                for p in _plain(t):
                    if _key(p) not in inputs:
                        self.track(p)
        return out

    def _freed(self, key: int, ref: weakref.ref) -> None:
        entry = self.live.get(key)
        if entry is not None and entry[0] is ref:
            del self.live[key]
            self.events.append((entry[2], -entry[1]))

    def _add(self, key: int, storage: torch.UntypedStorage, nbytes: int) -> int:
        self._serial += 1
        ref = weakref.ref(storage, functools.partial(self._freed, key))
        self.live[key] = (ref, nbytes, self._serial)
        self.events.append((self._serial, nbytes))
        return self._serial

    def track(self, t: torch.Tensor) -> int:
        """Count ``t``'s storage from now on (once); its serial. A wrapper subclass (a DTensor) holds
        no memory of its own: the tensors it wraps are counted (the serial is its first one's)."""
        if is_traceable_wrapper_subclass(t):
            return next((s for s in [self.track(p) for p in _plain(t)] if s), 0)
        storage = t.untyped_storage()
        # a storage's address is unique while it lives, and its death removes it from live
        key = StorageWeakRef(storage).cdata
        if key in self._baseline:
            return 0
        if key not in self.live:
            return self._add(key, storage, storage.nbytes())
        return self.live[key][2]

    def peak(self, exclude: set[int], upto: int | None = None) -> int:
        """The most bytes alive at once, over the first ``upto`` events (all: None), leaving out
        the storages of the serials in ``exclude``."""
        live = peak = 0
        for serial, delta in self.events[:upto]:
            if serial not in exclude:
                live += delta
                peak = max(peak, live)
        return peak

    def resized(self, storage: torch.UntypedStorage) -> None:
        """``storage`` changed size: the difference is counted; a storage grown from nothing that
        is not counted yet is counted from now on (FSDP2 frees a gathered parameter's storage with
        ``resize_(0)`` and allocates it again with ``resize_(n)``)."""
        key = StorageWeakRef(storage).cdata
        if key in self._baseline:
            return
        nbytes = storage.nbytes()
        if key not in self.live:
            if nbytes:
                self._add(key, storage, nbytes)
            return
        ref, counted, serial = self.live[key]
        self.live[key] = (ref, nbytes, serial)
        self.events.append((serial, nbytes - counted))

    @contextlib.contextmanager
    def watching_resizes(self) -> Iterator[None]:
        """Count storage resizes too until the block ends. ``UntypedStorage.resize_`` is no tensor op,
        so no dispatch mode sees it; it is wrapped for the block, as torch's own ``MemTracker`` does."""
        original = torch.UntypedStorage.resize_

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            out = original(storage, size)
            self.resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]  # same signature
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def checkpointed_modules(model: nn.Module, activation_checkpointing: Any) -> tuple[list[str], bool]:
    """(names of the modules ``activation_checkpointing`` wraps, whether it keeps matmul outputs):
    the choice the parallelize pipeline makes (:func:`kiln.parallel.transforms.levers.checkpoint_targets`)."""
    from kiln.parallel.transforms.levers import checkpoint_every, checkpoint_targets
    from kiln.parallel.transforms.parallelize import find_blocks

    mode = activation_checkpointing
    if mode is None:
        return [], False
    every = None if callable(mode) else checkpoint_every(mode)
    if not callable(mode) and every is None:
        raise ValueError(f"activation_checkpointing={mode!r} must be 'full', 'selective', 'selective:N' or a callable")
    return checkpoint_targets(model, mode, find_blocks(model)), every == 0


@contextlib.contextmanager
def _checkpointing(model: nn.Module, activation_checkpointing: Any) -> Iterator[None]:
    """The chosen modules' forwards under ``torch.utils.checkpoint`` until the block ends."""
    names, save_matmuls = checkpointed_modules(model, activation_checkpointing)
    if not names:
        yield
        return
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    context_fn: Callable[[], Any] = noop_context_fn
    if save_matmuls:  # torch's selective checkpointing with the policy kiln applies
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        from kiln.parallel.transforms.levers import save_matmuls_policy

        context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)

    saved: list[tuple[nn.Module, Any]] = []
    for name in names:
        module = model.get_submodule(name)
        saved.append((module, module.__dict__.get("forward")))
        inner = module.forward

        def forward(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            return checkpoint(
                _inner, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context_fn, **kwargs
            )

        module.forward = forward  # an instance forward for this run, undone below
    try:
        yield
    finally:
        for module, original in saved:
            if original is None:
                del module.forward
            else:
                module.forward = original  # the instance forward it had


def _call(model: nn.Module, example: Any) -> tuple[Any, torch.Tensor | None]:
    """The model's outputs on ``example``, and its loss when it has one (a kiln.Model's ``loss``, or
    an output's ``loss`` as Hugging Face models give)."""
    from kiln.core.model import Model

    if isinstance(model, Model):  # forward(batch), loss(outputs, batch)
        outputs = model(example)
        return outputs, model.loss(outputs, example)
    if isinstance(example, Mapping):
        outputs = model(**example)
    else:
        outputs = model(*example) if isinstance(example, tuple) else model(example)
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    return outputs, loss if isinstance(loss, torch.Tensor) else None


def _measure(model: nn.Module, example: Any, activation_checkpointing: Any, fake: bool) -> ActivationEstimate:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    fake_mode = FakeTensorMode() if fake else None

    def convert(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
        if fake_mode is not None:
            return fake_mode.from_tensor(t, static_shapes=True)
        return t.detach().clone() if copy else t.detach().requires_grad_(t.requires_grad)

    tensors = {n: convert(p) for n, p in model.named_parameters(remove_duplicate=False)}
    tensors.update({n: convert(b, copy=True) for n, b in model.named_buffers(remove_duplicate=False)})
    example = tree_map_only(torch.Tensor, lambda t: convert(t, copy=True), example)
    params = [p for p in {id(p): p for p in tensors.values()}.values() if p.requires_grad]
    baseline = [t for t in (*tensors.values(), *tree_flatten(example)[0]) if isinstance(t, torch.Tensor)]
    tracker = _LiveBytes(baseline)
    held: dict[int, int] = {}  # storages autograd saved: serial -> bytes

    def pack(t: torch.Tensor) -> torch.Tensor:
        for plain in _plain(t):
            serial = tracker.track(plain)
            if serial:  # not a parameter's, a buffer's or the input's (counted elsewhere or not ours)
                held[serial] = plain.untyped_storage().nbytes()
        return t

    with contextlib.ExitStack() as stack:
        if fake_mode is not None:
            stack.enter_context(fake_mode)
        else:
            stack.enter_context(torch.random.fork_rng(devices=[]))  # dropout's draws are put back
        # the stand-ins replace the parameters and buffers through the backward too: a checkpointed
        # block runs its forward again there (what torch.func.functional_call does for one call)
        stack.enter_context(_reparametrize_module(model, tensors, tie_weights=True))
        stack.enter_context(_checkpointing(model, activation_checkpointing))
        stack.enter_context(tracker)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs, loss = _call(model, example)  # the outputs stay alive, as state.outputs does
        saved = sum(nbytes for serial, nbytes in held.items() if serial in {s for _, _, s in tracker.live.values()})
        if loss is not None:
            roots, seeds = [loss], None
        else:  # no loss: every output that needs a gradient, seeded with ones
            roots = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            seeds = [torch.ones_like(t) for t in roots]
        grads = torch.autograd.grad(roots, params, seeds, allow_unused=True) if roots and params else ()
        gradient_serials = {tracker.track(g) for g in grads if g is not None}
    return ActivationEstimate(
        peak=tracker.peak(exclude=gradient_serials),
        saved=saved,
        activation_checkpointing=activation_checkpointing,
        method="fake tensors" if fake else "real tensors",
    )


def estimate_activations(
    model: nn.Module, example_input: Any, *, activation_checkpointing: Any = None
) -> ActivationEstimate:
    """Activation memory of one forward and backward of ``model`` on ``example_input`` (one microbatch).

    Args:
        model: the model, on any device (nothing is moved, computed on or changed).
        example_input: one microbatch as the forward takes it: the batch of a :class:`kiln.Model`;
            else a tensor, a tuple of positional arguments or a dict of keyword arguments.
        activation_checkpointing: ``None``, ``"full"``, ``"selective"``, ``"selective:N"`` or a
            callable, as :class:`kiln.parallel.transforms.parallelize.ParallelizeOptions` takes it.

    Example::

        estimate_activations(model, torch.randint(0, 256, (8, 1024)), activation_checkpointing="full").peak
    """
    checkpointed_modules(model, activation_checkpointing)  # a choice that names nothing: the user's to fix
    try:
        return _measure(model, example_input, activation_checkpointing, fake=True)
    except Exception:
        # the forward reads tensor values (fake tensors have none): measure one real microbatch
        return _measure(model, example_input, activation_checkpointing, fake=False)
