"""The bytes a searched plan's collectives move per optimizer step and rank, in closed form: what
kiln's dry run counts (:mod:`kiln.planning.comm_count`) on the plan's largest stage, by kind and mesh
dimension (``tests/test_search_vs_dry_run.py`` holds the two within 10% over a grid of plans;
:mod:`kiln.planning.search_cost` prices them in seconds).

Symbols: ``t`` tokens of a microbatch, ``h`` hidden, ``m`` microbatches, ``cb`` the compute dtype's
bytes, ``a`` the residual stream's (``cb`` under FSDP, fp32 under amp without it).

* FSDP gathers a stage's parameters in ``cb`` twice per microbatch (once a step in a pipeline,
  whose stages keep them gathered) and reduce-scatters its gradients once per step.
* Tensor parallelism with sequence parallelism (kiln's default where it has the model's plan:
  Llama, Mistral, Qwen2, inside pipeline stages too; loss parallelism too without a pipeline unless
  the embeddings are tied) gathers and reduce-scatters ``t x h`` per call: each block gathers ``2 a +
  2 cb`` (``4 a + 2 cb`` checkpointed) and reduce-scatters ``2 cb + 2 a`` (``3 cb + 2 a``) per
  microbatch, the head and the embedding's backward gather ``2 a`` more, loss parallelism
  reduce-scatters ``2 a`` more. A pipeline's last stage instead gathers ``cb + a`` more (its input's
  gradient, the head's input), the whole logits ``t x V x cb`` and, with the head split over the
  vocabulary, reduce-scatters ``a`` (the head's input gradient). The norms' weight gradients are
  all-reduced once a step, ``(2 x layers + 1) x h``: under FSDP in ``cb`` (fp32 when accumulated),
  without it in fp32 before clipping.
* Without it tensor parallelism all-reduces ``t x h`` 7 times per block and microbatch (8
  checkpointed): 2 forward in ``cb`` (3 checkpointed), 5 backward in ``cb``, or fp32 inside a
  pipeline stage without FSDP (traced in fp32; with FSDP a stage is traced in ``cb``).
* A pipeline sends each microbatch's activations in ``a`` and receives their gradients, and broadcasts
  the loss; with tied embeddings its first and last stage all-reduce the tied weight's gradient.
  Interleaved (2 stages a rank) a rank does so for each of its stages, and under sequence
  parallelism each stage boundary of its other stage gathers twice more (its output before the
  send, its input's gradient).
"""

from __future__ import annotations

import math

from kiln.planning.search_memory import precision_bytes, residual_bytes, stage_params
from kiln.planning.search_shape import ModelShape

__all__ = ["plan_collectives"]


def plan_collectives(
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
    stages_per_rank: int = 1,
) -> dict[str, dict[str, int]]:
    """Bytes per step of each collective of a plan of ``shape`` on its largest stage, ``{kind:
    {mesh dimension: bytes}}`` (the module docstring's terms)."""
    _, gb, cb, rb = precision_bytes(precision)
    m = microbatches
    sp, lp = shape.sequence_parallel_at(tp, pp), shape.loss_parallel_at(tp, pp)
    split = shape.vocab_split_at(tp, pp)
    layers = math.ceil(shape.num_layers / pp)
    first, last, _ = stage_params(shape, tp, pp, split)
    stage = max(first, last)
    t = micro_batch_size * seq_len  # tokens of one microbatch
    a = residual_bytes(precision, dp=dp, pp=pp)

    collectives: dict[str, dict[str, int]] = {}
    if dp > 1:
        # a forward and a backward gather per microbatch; a pipeline stage keeps its blocks gathered
        # across its microbatches (Hybrid's default under pp): one gather a step
        gathers = 1 if pp > 1 else 2 * m
        ag, rs = gathers * stage * cb, stage * gb
        collectives["all_gather"] = {"dp_shard": ag}
        collectives["reduce_scatter"] = {"dp_shard": rs}
    if sp:
        # each block gathers the sequence before its attention and its MLP (the norms' output, in the
        # residual's dtype) and reduce-scatters the row-wise projections' outputs (compute dtype)
        # after them; the backward runs their transposes (the gathers' on the outputs' gradients),
        # and a checkpointed block's recomputation gathers twice and reduce-scatters once more (it
        # stops before its last). Each call: one microbatch, t x h.
        per_token = t * shape.hidden
        ag_layer = (2 + (2 if checkpointing else 0)) * a + 2 * cb
        rs_layer = (2 + (1 if checkpointing else 0)) * cb + 2 * a
        if pp == 1:
            # the head gathers the sequence, and its transpose (the embedding's shards' gradient)
            # gathers too; with loss parallelism the embedding reduce-scatters its output and the
            # head its input's gradient
            ag_extra, rs_extra, logits = 2 * a, (2 * a if lp else 0), 0
        else:
            # the last stage (it holds the loss): its input, cut to the rank's sequence shard, gathers
            # its gradient; the head gathers the sequence and, split over the vocabulary, its input's
            # gradient reduce-scatters and its logits are gathered whole (t x V, no loss parallelism)
            # interleaved, the rank's other v - 1 stages' boundaries gather too: their output before the
            # send and their input's gradient
            ag_extra, rs_extra = cb + a + 2 * (stages_per_rank - 1) * a, (a if split else 0)
            logits = t * shape.vocab * cb if split else 0
        ag = ((layers * ag_layer + ag_extra) * per_token + logits) * m
        rs = (layers * rs_layer + rs_extra) * m * per_token
        collectives["all_gather"] = {**collectives.get("all_gather", {}), "tp": ag}
        collectives["reduce_scatter"] = {**collectives.get("reduce_scatter", {}), "tp": rs}
        # the sequence-parallel norms' weight gradients, partial sums over tp, all-reduced once a
        # step: inside FSDP's backward (fp32 when accumulated over microbatches), or without FSDP
        # before clipping and the optimizer (kiln.parallel.state.replicated_grads), in fp32
        ar = (2 * layers + 1) * shape.hidden * (cb if dp > 1 and m == 1 else gb)
        collectives["all_reduce"] = {"tp": ar}
    elif tp > 1:
        # each block all-reduces its attention's and its MLP's output in the forward (and the first
        # again in a checkpointed block's recomputation) and q, k, v, gate and up their input's
        # gradient in the backward: in the compute dtype, or in a pipeline stage without FSDP in the
        # trace's fp32 (with FSDP the stage is traced in the compute dtype)
        backward = rb if pp > 1 and dp == 1 else cb
        ar = ((3 if checkpointing else 2) * cb + 5 * backward) * layers * m * t * shape.hidden
        collectives["all_reduce"] = {"tp": ar}
    if pp > 1:
        # each microbatch's activations sent forward and their gradients back, in the trace's dtype
        # (the residual stream's: the compute dtype under FSDP, else fp32 under amp), once per
        # neighbour; and the loss broadcast (one fp32 scalar)
        # (a rank of an interleaved pipeline sends and receives for each of its v stages: the first
        # and last ranks 4v - 2 a microbatch, the others 4v)
        v = stages_per_rank
        p2p = (4 * v - 2 if pp == 2 else 4 * v) * m * t * shape.hidden * a
        collectives["p2p"] = {"pp": p2p}
        collectives["broadcast"] = {"pp": 4}
        if shape.tied:
            # the first stage's embedding and the last stage's head, copies of one tied weight, sum
            # their gradients once a step over the pair (kiln.parallel.pipelining.tied_weights): the
            # rank's shard (FSDP's over dp; the tied weight is never split over tp), in the grads' dtype
            collectives["all_reduce"] = {
                **collectives.get("all_reduce", {}),
                "pp": shape.vocab * shape.hidden * gb // dp,
            }
    return collectives
