"""Memory per rank of a searched plan, in closed form: what kiln's dry run measures of the plan's
largest stage (:mod:`kiln.planning.search_cost` prices the search's plans with :func:`plan_memory`;
``tests/test_search_vs_dry_run.py`` holds the two within 10% over a grid of plans). The bytes per
element of kiln's precisions (:func:`precision_bytes`, :func:`residual_bytes`) live here too.

Per rank, in bytes (``pb``/``gb``: parameter and reduced-gradient bytes per element; ``S``: the
stage's parameters, its blocks' attention and MLP Linears divided by ``tp``, the embedding and LM
head too where they are split over the vocabulary): parameters ``S/dp x pb``, gradients ``S/dp x gb``, optimizer
state ``k x S/dp x pb`` (AdamW: k = 2).

Activations are the most bytes alive at once in a step's forwards and backwards, less the
gradients, as the dry run counts them (FSDP's gathered parameters and buffers included): the
largest of three moments of the step, each a sum of what is alive then. Symbols: ``t = b x s``
tokens of one microbatch (``b`` sequences of ``s`` tokens), ``L`` the stage's blocks, ``h`` the
hidden size, ``d`` the head size, ``q = n x d`` the query width, ``k`` the keys' (``q`` under
grouped-query attention, whose repeated keys and values are what attention saves; else the
key/value width), ``f`` the MLP's intermediate size, ``V`` the vocabulary, ``T`` the
tensor-parallel size, ``Q`` the sequence shards (``T`` under sequence parallelism, else 1), ``c``
the compute dtype's bytes (2), ``a`` the residual stream's (``c`` under FSDP, whose bf16 parameters
make the embedding's output bf16, in a pipeline stage too, traced in them; 4 under amp without
FSDP), ``P`` one block's parameters, ``R`` the embedding's and head's (over ``T`` where
they are split over the vocabulary: sequence parallelism, untied):

* a block, not checkpointed, saves ``2t((4 + a)h/Q + 4/Q)`` for its two norms (the fp32 input or
  its copy, the normalised output, 1/rms, on the sequence shard), ``x t h c`` for the projections'
  input whole (the gathered sequence under sequence parallelism; ``x`` = 2 from a bf16 stream, 5
  from an fp32 one, where q, k, v, gate and up each cast it), ``t(c(2q + 2k)/T + 4n/T)`` for
  attention (rotated queries, keys, values, output, log-sum-exp), ``4 t f c / T`` for the MLP (gate,
  up, activation, product) and ``b s^2 c`` for attention's mask; checkpointed, its input
  ``t h a / Q``, with the boolean causal mask ``b s^2`` kept once;
* **the loss**: every block's saved tensors, the final norm's and the head's input
  ``t((4 + a)h/Q + 4/Q) + t h c``, the rotary tables ``2 s d a``, and the loss's: under loss
  parallelism ``10 t V / T`` (the bf16 logits of the vocabulary shard, the fp32 log-softmax and its
  gradient), otherwise ``12 t V`` (three fp32 ``t x V``: the log-softmax, its input's and output's
  gradients) plus FSDP's root gathered again for the backward and the last block prefetched,
  ``(R + P) c`` (the loss is the model's own output there);
* **a checkpointed block's backward**: ``L - 1`` kept inputs, the block recomputed with its
  gradients' temporaries ``2 t f c / T + t h a``, FSDP's block and the next one gathered and the
  block's fp32 gradients, ``2 P c + 4 P``, and the root ``R c``;
* **the embedding's backward** (under FSDP): its gradient over the whole vocabulary ``V h c`` (a
  vocabulary-split embedding's backward computes it whole, then keeps its rows), the root gathered
  and its gradients ``2 R c``, the first block's fp32 gradient buffer ``4 P``.

Each moment also holds the rotary tables, the boolean mask when checkpointed, and, under FSDP with
``microbatches > 1``, the unsharded fp32 gradients kept between microbatches, ``S x 4`` (a
vocabulary-split embedding's over the whole vocabulary, on the stage that holds the embedding). A
pipeline's moments (its first rank's warm-up, after its first backward, its embedding's backward;
its last rank's loss) are :func:`_pipeline_moments`'.

Llama-3-8B at FSDP 64 x TP 8, one sequence of 8192 tokens, every block checkpointed, amp_bf16:
the loss moment is 256 (blocks) + 88 (final norm, head input) + 4 (rotary) + 64 (mask) + 1,252.5
(logits) = 1,664.5 MiB, the embedding's backward 1,002 + 501 + 104 + 68 = 1,675.0 MiB; the dry run
measures 1,664.6 MiB (at the loss). docs/planning.md has the table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the shape's type only: search_shape imports torch's nn at import time
    from kiln.planning.search_shape import ModelShape

__all__ = ["PRECISION_BYTES", "PlanMemory", "plan_memory", "precision_bytes", "residual_bytes", "stage_params"]

# (parameter, reduced gradient, compute, residual stream) bytes per element, by kiln precision name
PRECISION_BYTES = {
    "amp_bf16": (4, 4, 2, 4),
    "amp_fp16": (4, 4, 2, 4),
    "bf16": (2, 2, 2, 2),
    "fp16": (2, 2, 2, 2),
    "fp32": (4, 4, 4, 4),
}
_F32 = 4


def precision_bytes(precision: str | None) -> tuple[int, int, int, int]:
    """(parameter, gradient, compute, residual) bytes per element of a kiln precision name."""
    name = precision or "fp32"
    if name not in PRECISION_BYTES:
        raise ValueError(f"precision={name!r} cannot be planned; expected one of {', '.join(PRECISION_BYTES)}")
    return PRECISION_BYTES[name]


def residual_bytes(precision: str, *, dp: int, pp: int) -> int:
    """Bytes per element of the residual stream: FSDP gathers amp's parameters in the compute dtype,
    so the embedding's output and every add after it are in it (in a pipeline stage too, traced in
    it); without FSDP autocast leaves them fp32."""
    _, _, cb, rb = precision_bytes(precision)
    return cb if (dp > 1 or not precision.startswith("amp")) else rb


@dataclass(frozen=True)
class PlanMemory:
    """Bytes per rank of a plan's largest stage; ``moments`` are the activation moments of the
    module docstring (``loss``, ``block_backward``, ``embedding_backward``) of that stage."""

    params: int
    grads: int
    optimizer: int
    activations: int
    moments: dict[str, int] = field(default_factory=dict)
    pipeline: bool = False

    @property
    def total(self) -> int:
        # a pipeline's activations peak in its forwards (the first stage's warm-up, the last stage's
        # loss), before the step's gradients exist (FSDP makes the sharded ones in the last
        # backward, when the activations are gone): the larger of the two, not their sum
        if self.pipeline:
            return self.params + self.optimizer + max(self.activations, self.grads)
        return self.params + self.grads + self.optimizer + self.activations


def stage_params(shape: ModelShape, tp: int, pp: int, vocab_split: bool) -> tuple[int, int, int]:
    """(parameters of the first stage, of the last, of one block) on one tensor-parallel rank."""
    layers = math.ceil(shape.num_layers / pp)
    block = shape.layer_params - shape.layer_split_params + shape.layer_split_params // tp
    # a pipeline's last stage holds its own copy of a tied head: torch's split copies a weight two
    # stages use into each (the first stage keeps one too, unused: not counted here)
    embed, head = shape.embed_params, (shape.head_params if pp == 1 else shape.vocab * shape.hidden)
    if vocab_split:
        embed, head = embed // tp, head // tp
    norm = shape.hidden
    first = layers * block + embed + (head + norm if pp == 1 else 0)
    last = layers * block + head + norm + (embed if pp == 1 else 0)
    return first, last, block


def _pipeline_moments(
    shape: ModelShape,
    first: int,
    last: int,
    block: int,
    *,
    pp: int,
    v: int,
    m: int,
    t: int,
    kept: int,
    full: int,
    out: int,
    temporaries: int,
    final_norm: int,
    fsdp: bool,
    amp: bool,
    cb: int,
    gb: int,
    whole_embedding: int,
    fixed: int,
) -> dict[str, int]:
    """The moments of a pipeline's first rank (the end of its warm-up, after its first backward, its
    embedding's backward) and of its last (the loss), as the dry run measures them (docs/planning.md:
    what the 70B stages hold).

    A stage keeps its blocks gathered from its first forward to its last backward (Hybrid's default
    under pp), and each in-flight microbatch its blocks' kept inputs and its output (held for its
    backward: the whole sequence, gathered under sequence parallelism, ``t h a``). In flight at a
    rank's first backward: 1F1B's min(pp, m) on the first rank, 1 on the last; interleaved (v stages
    of L / v layers a rank), torch's warm-up of (v - 1) rounds of pp and 2 more a rank from the last,
    then one forward. Where the warm-up runs every forward (m <= pp under 1F1B), no gradient exists
    yet at its end; FSDP keeps a stage's unsharded fp32 gradients from its first backward to its last
    (under interleaving, with every forward in the warm-up, one stage of the rank runs all its
    backwards, and frees its gradients' full copies, before the other starts). The loss: the logits
    (under amp in the trace's dtype: FSDP's compute dtype, else cast back to fp32), the
    log-softmax, its input's and its output's gradients, in fp32 (without amp: all four in the
    parameters' dtype)."""
    chunk = math.ceil(shape.num_layers / (pp * v))
    if v == 1:
        first_chunks, last_chunks = min(pp, m), 1
    else:
        first_chunks = min(m * v, (v - 1) * pp + 2 * (pp - 1) + 1)
        last_chunks = min(m * v, (v - 1) * pp + 1)
    steady = m * v > first_chunks  # forwards left after the first backward
    one_at_a_time = v > 1 and not steady  # the rank's stages run their backwards one after the other
    accumulate = fsdp and m > 1
    gathered_first, gathered_last = (first * cb, last * cb) if fsdp else (0, 0)
    grads_first = first * gb + whole_embedding if accumulate else 0
    grads_last = last * gb if accumulate else 0
    # the first stage, and the last, of a rank's v: its embedding or its head with chunk blocks
    embedding = first - (v * chunk) * block
    if one_at_a_time:
        grads_last = (last - (v - 1) * chunk * block) * gb if accumulate else 0
    # after the first rank's first backward, one microbatch fewer in flight and the next one's block
    # recomputed, with the gradients of the stage that ran it (under interleaving with every forward in
    # the warm-up: the rank's later stage, with no embedding)
    grads_after = grads_first
    if one_at_a_time:
        grads_after = chunk * block * gb if accumulate else 0
    moments = {
        "first_stage": first_chunks * (chunk * kept + out) + full + gathered_first + fixed
        + (grads_first if steady else 0),
        "after_first_backward": (first_chunks - 1) * (chunk * kept + out) + full + (temporaries if full else 0)
        + gathered_first + grads_after + fixed,
        "loss": last_chunks * chunk * kept + (last_chunks - 1) * out * (v > 1) + final_norm
        + t * shape.vocab * ((12 + (cb if fsdp else _F32)) if amp else 4 * cb) + gathered_last + grads_last + fixed,
    }  # fmt: skip
    # the embedding's first backward: its gradient over the whole vocabulary in the compute dtype
    # (vocabulary-split: computed whole, then its rows kept); under interleaving with every forward
    # in the warm-up, the rank's other stage is done (its gradients and gathered blocks gone) and
    # only the first stage's m microbatches are in flight
    in_flight = m if one_at_a_time else first_chunks
    stage_first = (chunk * block + embedding) if one_at_a_time else first
    moments["embedding_backward"] = (
        (in_flight - 1) * chunk * kept + in_flight * out + shape.vocab * shape.hidden * cb
        + (stage_first * cb if fsdp else 0) + (stage_first * gb + whole_embedding if accumulate else 0) + fixed
    )  # fmt: skip
    return moments


def plan_memory(
    shape: ModelShape,
    *,
    dp: int,
    tp: int,
    pp: int,
    checkpointing: bool,
    micro_batch_size: int,
    microbatches: int,
    seq_len: int,
    precision: str,
    optimizer_factor: int,
    stages_per_rank: int = 1,
) -> PlanMemory:
    """The closed form of the module docstring for a plan of ``shape`` (``stages_per_rank`` 2:
    interleaved 1F1B)."""
    pb, gb, cb, _ = precision_bytes(precision)
    amp = precision.startswith("amp")
    sp, lp = shape.sequence_parallel_at(tp, pp), shape.loss_parallel_at(tp, pp)
    split = shape.vocab_split_at(tp, pp)
    fsdp = dp > 1
    first, last, block = stage_params(shape, tp, pp, split)
    stage = max(first, last)
    shard = math.ceil(stage / dp)
    params, grads, optimizer = shard * pb, shard * gb, optimizer_factor * shard * pb
    if split and not fsdp:
        # the vocabulary-split embedding's gradient is a slice of the whole vocabulary's (DTensor
        # computes the embedding's backward whole), and the slice keeps that storage
        grads += (shape.embed_params - shape.embed_params // tp) * gb

    m, b, s = microbatches, micro_batch_size, seq_len
    t = b * s
    h, V, d = shape.hidden, shape.vocab, shape.head_dim
    q, kv, n, f = shape.heads * d, shape.kv_heads * d, shape.heads, shape.ffn
    T, Q = tp, (tp if sp else 1)
    a = residual_bytes(precision, dp=dp, pp=pp)
    layers = math.ceil(shape.num_layers / pp)

    # a norm: its fp32 input (a copy unless the stream is fp32 already) and normalised output on the
    # sequence shard, and its fp32 1/rms; then the projections' input whole (the gathered sequence
    # under sequence parallelism) in the compute dtype: the norms' two outputs, or, from an fp32
    # stream, autocast's five copies (q, k, v, gate and up each cast their input)
    norm = t * (_F32 + a) * h // Q + t * _F32 // Q
    inputs = (5 if a > cb else 2) * t * h * cb
    # the rotated queries, the keys and values (repeated to the query heads under grouped-query
    # attention: the repeat is what attention saves), attention's output and its log-sum-exp; its
    # mask in the compute dtype
    keys = q if kv < q else kv
    attention = t * (cb * (2 * q + 2 * keys) // T + _F32 * n // T) + b * s * s * cb
    full = 2 * norm + inputs + attention + t * 4 * cb * f // T
    final_norm = norm + t * h * cb  # and the head's input
    kept = t * h * a // Q if checkpointing else full
    rotary = 2 * s * d * a
    mask = b * s * s if checkpointing else 0
    vocab_rows = T if split else 1
    root = (shape.embed_params + shape.head_params) // vocab_rows * cb if fsdp else 0
    gathered_block = block * cb if fsdp else 0
    # FSDP keeps unsharded fp32 gradients between microbatches (of accumulation, or of a pipeline);
    # a vocabulary-split embedding's is the whole vocabulary's (its backward computes it whole), on
    # the stage that holds the embedding: a pipeline's first, not its last (counting it there put
    # Llama-3-8B's last stage at 32 x 8 x 2 1.71 GiB over the dry run, 70B's 3.67)
    accumulated = whole_embedding = 0
    if fsdp and m > 1:
        accumulated = stage * gb
        whole_embedding = (shape.embed_params - shape.embed_params // T) * gb * split

    # a recomputed block's gradients' temporaries (the MLP's two, the sequence gathered once more)
    temporaries = 2 * t * cb * f // T + t * h * a
    if pp > 1:
        moments = _pipeline_moments(
            shape, first, last, block, pp=pp, v=stages_per_rank, m=m, t=t, kept=kept, full=full if checkpointing else 0,
            out=t * h * a, temporaries=temporaries, final_norm=final_norm, fsdp=fsdp, amp=amp, cb=cb, gb=gb,
            whole_embedding=whole_embedding, fixed=rotary + mask,
        )  # fmt: skip
    else:
        moments = {}
        common = rotary + mask + accumulated + whole_embedding  # the one stage holds the embedding
        if lp:
            # the vocabulary shard's bf16 logits (held by the loss's graph), its log-softmax and gradient
            loss = 10 * t * V // T
        else:
            # inside the model, three fp32 t x V tensors; the loss being the root's output, FSDP has
            # gathered the root again and prefetched the last block for the backward
            loss = 12 * t * V + root + gathered_block
        moments["loss"] = layers * kept + final_norm + loss + common
        if checkpointing:
            # the last block recomputed with its gradients' temporaries; FSDP's block, the next one
            # prefetched, the block's fp32 gradients
            fsdp_block = (2 * gathered_block + block * gb if fsdp else 0) + root
            moments["block_backward"] = (layers - 1) * kept + full + temporaries + fsdp_block + common
        if fsdp:
            # the embedding's gradient over the whole vocabulary, the gathered root and its
            # gradients, the first block's fp32 gradient buffer
            moments["embedding_backward"] = V * h * cb + 2 * root + block * _F32 + common
    activations = max(moments.values())
    return PlanMemory(params, grads, optimizer, activations, moments, pipeline=pp > 1)
