"""Context parallelism: each sequence of a batch split over the ``cp`` ranks, attention as a ring.

Long sequences make a causal LM's activations grow with the sequence length (and attention's
compute with its square). Under ``Hybrid(cp=N)`` (YAML ``compute_config.cp``) the ``N`` ranks of a
context-parallel group read the same batch and each keeps ``1/N`` of every sequence: torch's
``torch.distributed.tensor.experimental.context_parallel`` shards the batch's sequence buffers and
replaces ``scaled_dot_product_attention`` by ring attention, in which every rank's queries meet
every rank's keys and values as those travel around the group (torch's ``allgather`` or
``alltoall`` rotation). Everything else a block does is per token and needs nothing.

One training microbatch, :meth:`ContextParallel.step`:

1. :func:`prepare_batch` adds what a sequence shard cannot compute itself: ``position_ids``
   (a shard's positions are not ``0..len-1``) and ``shift_labels``, the labels moved one to the
   left (the label of position ``t`` is token ``t + 1``, which may sit on another rank once the
   sequence is split; transformers' causal-LM loss takes ``shift_labels`` for the same reason).
2. torch shards ``input_ids``, ``labels``, ``position_ids`` and ``shift_labels`` on dim 1 in its
   load-balanced order (head-tail: the sequence cut in ``2N`` chunks, rank ``r`` keeps chunks
   ``r`` and ``2N - 1 - r``, so every rank gets the same share of the causal mask's work), and
   puts them back in place when the step ends.
3. The forward and backward run inside torch's context; :meth:`ContextParallel.reduce_loss`
   turns each rank's loss, the mean over its own tokens, into the mean over the whole sequence:
   its value is the cp group's token-weighted mean, its gradient the local one times
   ``cp * local_tokens / all_tokens``, so that FSDP's average over the ``cp`` ranks (FSDP shards
   over ``dp_shard x cp``, torchtitan's layout) gives the gradient of the whole-sequence mean,
   exactly as one process would have it, whatever share of ignored labels each shard holds.

torch's ring attention has sharding rules for the CUDA attention kernels (flash, efficient,
cuDNN) only: ``cp > 1`` is refused on any other device (:func:`check_context_parallel`). The dry
run (:mod:`kiln.planning.dry_run`, CPU and fake tensors) runs ``ContextParallel(ring=False)``
instead: torch's split and the same loss reduction, with attention over keys and values
all-gathered over ``cp`` (what torch's ``allgather`` rotation moves and holds), so ``kiln plan
--dry-run`` counts the sequence's share of the activations and the ring's bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from kiln.core.batch import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "SEQUENCE_KEYS",
    "ContextParallel",
    "check_context_parallel",
    "prepare_batch",
]

# The batch entries split on the sequence dimension (dim 1), in this order.
SEQUENCE_KEYS = ("input_ids", "labels", "position_ids", "shift_labels")


def check_context_parallel(cp: int, device_type: str) -> None:
    """Refuse ``cp > 1`` where torch's ring attention cannot run; one line saying why. Runs no collective."""
    if cp > 1 and device_type != "cuda":
        raise ValueError(
            f"cp={cp} needs CUDA devices, got {device_type}: torch {torch.__version__}'s context_parallel "
            f"(ring attention) has sharding rules only for the CUDA attention kernels (flash, efficient, "
            f"cuDNN), none for {device_type}'s; run on GPUs, or set cp=1"
        )


def prepare_batch(batch: Any) -> list[str]:
    """Add ``position_ids`` and ``shift_labels`` to a dict ``batch`` in place, from its
    ``input_ids`` (and ``labels``, else the inputs); returns the keys it added. Both are computed on
    the whole sequence, before it is split: see the module's docstring."""
    if not isinstance(batch, MutableMapping) or "input_ids" not in batch:
        kind = (
            f"a dict with keys {sorted(map(str, batch))}" if isinstance(batch, MutableMapping) else type(batch).__name__
        )
        raise TypeError(
            f"context parallelism splits a batch's sequences and takes dict batches with 'input_ids' "
            f"(and 'labels'), got {kind}; have the dataset or collate_fn return such dicts"
        )
    tokens = batch["input_ids"]
    added = []
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(tokens.shape[1], device=tokens.device).repeat(tokens.shape[0], 1)
        added.append("position_ids")
    if "shift_labels" not in batch:
        labels = batch.get("labels", tokens)
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        batch["shift_labels"] = shifted
        added.append("shift_labels")
    return added


class ContextParallel:
    """The context-parallel step of one ``cp`` mesh (what ``Hybrid(cp=N)`` runs each microbatch).

    Args:
        mesh: the 1-D ``cp`` device mesh.
        rotate_method: how torch's ring passes keys and values on: ``"allgather"`` (torch's
            default) or ``"alltoall"``.
        ring: torch's ring attention (CUDA); ``False``: the dry run's stand-in (see the module's
            docstring), plain attention on keys and values all-gathered over the ``cp`` ranks.

    Example::

        cp = ContextParallel(mesh["cp"])
        with cp.step(batch):                       # batch's sequences are this rank's shards now
            loss = cp.reduce_loss(model.loss(model(batch), batch))
            loss.backward()
    """

    def __init__(self, mesh: Any, *, rotate_method: str = "allgather", ring: bool = True) -> None:
        if rotate_method not in ("allgather", "alltoall"):
            raise ValueError(f"rotate_method={rotate_method!r} must be 'allgather' or 'alltoall'")
        self.mesh, self.rotate_method = mesh, rotate_method
        self.size, self.ring = mesh.size(), ring
        self._tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # valid labels: (this shard, all shards)

    @property
    def active(self) -> bool:
        """Whether a :meth:`step` is running (the loss is then a shard's and needs :meth:`reduce_loss`)."""
        return self._tokens is not None

    def check_sequence(self, length: int) -> None:
        """One line when torch's head-tail split cannot cut ``length`` tokens into ``2 * cp`` equal chunks."""
        if length % (2 * self.size):
            raise ValueError(
                f"context parallelism over cp={self.size} ranks needs sequences whose length divides by "
                f"2 * cp = {2 * self.size} (torch's load-balanced split cuts each into 2 * cp equal chunks), "
                f"got {length} tokens; pad or cut the sequences to a multiple of {2 * self.size}"
            )

    @contextmanager
    def step(self, batch: Any) -> Iterator[None]:
        """Split ``batch``'s sequences (in place) for the forward and backward run inside, with
        torch's ring attention in place of ``scaled_dot_product_attention``; put them back afterwards."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        added = prepare_batch(batch)
        self.check_sequence(batch["input_ids"].shape[1])
        keys = [k for k in SEQUENCE_KEYS if k in batch]
        originals = {k: batch[k] for k in keys}
        # torch shards the buffers in place (resize_ and copy_): each gets a fresh copy, since a
        # batch's tensors may be views of a larger batch (microbatches) or one object under two
        # keys (labels = input_ids), which would be cut twice. The originals go back afterwards.
        buffers = [batch[k].clone(memory_format=torch.contiguous_format) for k in keys]
        batch.update(zip(keys, buffers))
        set_rotate_method(self.rotate_method)  # a module-level setting in torch: set on every step
        try:
            with context_parallel(
                self.mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
            ):
                # The valid labels of this shard and of the whole sequence, for reduce_loss: one
                # small all-reduce per microbatch, kept on the device (no host sync).
                local = (batch["shift_labels"] != IGNORE_INDEX).sum().to(torch.float64)
                total = local.clone()
                dist.all_reduce(total, group=self.mesh.get_group())
                self._tokens = (local, total)
                if self.ring:
                    yield
                else:
                    with _gathered_attention(self.mesh.get_group(), batch["position_ids"]):
                        yield
        finally:
            self._tokens = None
            batch.update(originals)
            for key in added:
                del batch[key]

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (this shard's mean over its valid labels) made the mean over the whole sequence:
        the value is the cp group's token-weighted mean, the gradient the local one times
        ``cp * local_tokens / all_tokens`` (FSDP then averages over the ``cp`` ranks)."""
        if self._tokens is None:
            raise RuntimeError("ContextParallel.reduce_loss runs inside ContextParallel.step(batch)")
        local, total = self._tokens[0].to(loss.dtype), self._tokens[1].clamp(min=1).to(loss.dtype)
        weight = self.size * local / total
        summed = (loss.detach() * local).reshape(1)
        dist.all_reduce(summed, group=self.mesh.get_group())
        # value: the whole sequence's mean; gradient: weight times this shard's
        return loss * weight + (summed[0] / total - loss.detach() * weight)


class _Gather(torch.autograd.Function):
    """Every cp rank's ``x`` concatenated on dim 2 (the sequence of ``(batch, heads, seq, dim)``);
    the backward reduce-scatters the gradient back (each rank's keys served every rank's queries)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        front = x.movedim(2, 0).contiguous()
        out = front.new_empty((size * front.shape[0], *front.shape[1:]))
        dist.all_gather_into_tensor(out, front, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        size = dist.get_world_size(ctx.group)
        front = grad.movedim(2, 0).contiguous()
        out = front.new_empty((front.shape[0] // size, *front.shape[1:]))
        dist.reduce_scatter_tensor(out, front, group=ctx.group)
        return out.movedim(0, 2), None


@contextmanager
def _gathered_attention(group: Any, positions: torch.Tensor) -> Iterator[None]:
    # torch's context_parallel patched scaled_dot_product_attention with its ring on entry; this
    # puts a plain one on gathered keys and values in its place for the inside, and torch's back
    # before torch's exit restores the original (it restores only its own function).
    import torch.nn.functional as F

    plain = torch._C._nn.scaled_dot_product_attention
    every = _Gather.apply(positions[:, None, :, None], group)[:, 0, :, 0]  # (batch, seq) in rank order

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("is_causal", None)
        mask = positions[:, None, :, None] >= every[:, None, None, :]  # causal over global positions
        return plain(q, _Gather.apply(k, group), _Gather.apply(v, group), attn_mask=mask, **kwargs)

    ring = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = attention  # type: ignore[assignment]  # called with its own keywords only
    try:
        yield
    finally:
        F.scaled_dot_product_attention = ring
