"""Context parallelism on CPU (gloo), 2 ranks: what runs without torch's CUDA ring attention.

Usage: cp_worker.py OUT. Rank 0 writes OUT/cp.json with, per rank:

* ``shard``: the input ids, labels, position ids and shift labels a rank holds inside
  ``ContextParallel.step`` (torch's own load-balanced split), the batch after the step (same keys,
  the same tensor objects), and the shards gathered back with torch's ``context_parallel_unshard``;
* ``refused``: the error of ``Hybrid(cp=2)`` on a CPU device (the real Engine setup);
* ``parity`` / ``parity_unweighted``: a tiny dense MoELlama in float64, plain SGD, 3 steps, through
  the Engine's ``train_step`` under ``Hybrid(cp=2)`` (FSDP over the cp ranks; the CPU refusal
  lifted), with the attention replaced by a plain reference on gathered sequences (this rank's
  queries against every rank's keys and values, all-gathered over cp, masked by the global
  positions), against one process on whole sequences: every step's loss, the first step's full
  gradients, the weights after 3 steps. ``parity_unweighted`` runs with ``reduce_loss`` returning
  each shard's own mean (no weighting by its tokens): the test expects it to fail.
"""

import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import kiln
import kiln.parallel.hybrid as hybrid_module
from kiln.parallel import Hybrid, full_model_state_dict
from kiln.parallel.context import IGNORE_INDEX, ContextParallel

LR, STEPS, BATCH, SEQ, VOCAB = 0.5, 3, 2, 16, 32


def make_model():
    torch.manual_seed(0)
    model = kiln.models.MoELlama(
        vocab_size=VOCAB, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=SEQ, num_dense_layers=2
    )
    return model.double()


def batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = tokens.clone()
        # sequence 0's labels 5..12 (shifted: positions 4..11) ignored: all of rank 1's share of
        # it, so the ranks' shards hold 14 and 8 valid labels (reduce_loss's weights matter)
        labels[0, 5:13] = IGNORE_INDEX
        out.append({"input_ids": tokens, "labels": labels})
    return out


def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, batch in enumerate(batches()):
        opt.zero_grad(set_to_none=True)
        loss = model.loss(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


class Gather(torch.autograd.Function):
    """Every cp rank's ``x`` concatenated on ``dim``; the backward sums the ranks' gradients and
    keeps this rank's slice. (torch.distributed.nn's all_gather sends non-contiguous gradients
    through gloo's all-to-all and gets them wrong.)"""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        mine = grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[dist.get_rank(ctx.group)]
        return mine.contiguous(), None, None


class GatheredAttention(ContextParallel):
    """torch's step (its sequence split), with the attention replaced by a plain one on gathered
    keys and values: torch's ring attention has no CPU kernel."""

    @contextlib.contextmanager
    def step(self, batch):
        with super().step(batch):
            group = self.mesh.get_group()
            positions = batch["position_ids"]  # this rank's shard
            every = Gather.apply(positions, 1, group)

            def attention(q, k, v, is_causal=False, **_):
                assert is_causal
                keys, values = Gather.apply(k, 2, group), Gather.apply(v, 2, group)
                mask = positions[:, None, :, None] >= every[:, None, None, :]
                return torch_sdpa(q, keys, values, attn_mask=mask)

            ring = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = attention
            try:
                yield
            finally:
                F.scaled_dot_product_attention = ring  # torch's exit restores from its own function


torch_sdpa = F.scaled_dot_product_attention


def full_grads(model):
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _diff(got, want):
    common = [k for k in want if k in got]
    if len(common) != len(want):
        return float("inf")
    return max((got[k] - want[k]).abs().max().item() for k in common)


def run_parity(ref, unweighted=False):
    ref_losses, ref_grads, ref_weights = ref
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    check = hybrid_module.check_context_parallel
    hybrid_module.check_context_parallel = lambda cp, device_type: None  # the test's reference attention runs on CPU
    try:
        engine = kiln.Engine(model, opt, lambda out, batch: model.loss(out, batch), strategy=Hybrid(cp=2))
    finally:
        hybrid_module.check_context_parallel = check
    strategy = engine.strategy
    strategy.context_parallel = GatheredAttention(strategy.context_parallel.mesh)
    if unweighted:
        strategy.context_parallel.reduce_loss = lambda loss: loss
    losses, grads = [], {}
    for step, batch in enumerate(batches()):

        def keep_grads(step=step):
            if step == 0:
                grads.update(full_grads(engine.module))

        loss = engine.train_step([batch], lambda mb: engine.criterion(engine(mb), mb), before_optimizer_step=keep_grads)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    weights = {k: v.detach().clone() for k, v in full_model_state_dict(engine).items()}
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_abs": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "grad_abs": _diff(grads, ref_grads),
        "weight_abs": _diff(weights, ref_weights),
        "mesh": list(engine.strategy.resolved_dims.mesh_shape()[1]),
    }


def shard_case(mesh):
    tokens = torch.arange(2 * SEQ).view(2, SEQ)
    batch = {"input_ids": tokens, "labels": tokens}  # one object under two keys: cut once each
    cp = ContextParallel(mesh)
    with cp.step(batch):
        inside = {k: batch[k].tolist() for k in sorted(batch)}
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        gathered = context_parallel_unshard(mesh, [batch["input_ids"], batch["shift_labels"]], [1, 1])
    return {
        "inside": inside,
        "after_keys": sorted(batch),
        "after_same_objects": batch["input_ids"] is tokens and batch["labels"] is tokens,
        "after_input_ids": batch["input_ids"].tolist(),
        "unshard_input_ids": gathered[0].tolist(),
        "unshard_shift_labels": gathered[1].tolist(),
    }


def main():
    out = sys.argv[1]
    ctx = kiln.launch_from_torch(seed=0)
    from torch.distributed.device_mesh import init_device_mesh

    result = {"shard": shard_case(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))}
    try:
        kiln.Engine(make_model(), None, strategy=Hybrid(cp=2))
        result["refused"] = None
    except ValueError as error:
        result["refused"] = str(error)
    ref = reference()
    result["parity"] = run_parity(ref)
    result["parity_unweighted"] = run_parity(ref, unweighted=True)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if ctx.rank == 0:
        with open(os.path.join(out, "cp.json"), "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
