"""Context parallelism with torch's own ring attention, on every GPU of the machine (one rank each).

Usage: cp_gpu_worker.py OUT. Rank 0 writes OUT/cp_gpu.json. Every rank computes one process's
loss and gradients on whole sequences (plain attention), then:

* ``direct``: ``ContextParallel.step`` on a ``cp`` mesh of all ranks (one GPU: a ring of one, which
  still runs torch's CP dispatch and its attention kernels on the shards) with ``reduce_loss``,
  gradients averaged over the ranks as FSDP would;
* ``hybrid`` (2 GPUs or more): 2 SGD steps through ``Engine.train_step`` under ``Hybrid(cp=N)``.

Each reports the largest difference of losses, gradients (and weights) from the reference.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

import kiln
from kiln.parallel import Hybrid, full_model_state_dict
from kiln.parallel.context import IGNORE_INDEX, ContextParallel

BATCH, SEQ, VOCAB, LR, STEPS = 2, 64, 64, 0.1, 2


def make_model(device):
    torch.manual_seed(0)
    model = kiln.models.MoELlama(
        vocab_size=VOCAB, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=SEQ, num_dense_layers=2
    )
    return model.to(device)


def batches(device):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = tokens.clone()
        labels[0, 5:30] = IGNORE_INDEX  # uneven valid labels over the shards
        out.append({"input_ids": tokens.to(device), "labels": labels.to(device)})
    return out


def _diff(got, want):
    if set(got) != set(want):
        return float("inf")
    return max((got[k].float().cpu() - want[k].float().cpu()).abs().max().item() for k in want)


def reference(device):
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step, batch in enumerate(batches(device)):
        opt.zero_grad()
        loss = model.loss(model(batch), batch)
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def direct(device, mesh, ref):
    model = make_model(device)
    cp = ContextParallel(mesh)
    batch = batches(device)[0]
    with cp.step(batch):
        loss = cp.reduce_loss(model.loss(model(batch), batch))
        loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"loss_abs": abs(loss.item() - ref[0][0]), "grad_abs": _diff(grads, ref[1])}


def hybrid(device, ref):
    from torch.distributed.tensor import DTensor

    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = kiln.Engine(model, opt, lambda out, b: model.loss(out, b), strategy=Hybrid(cp=dist.get_world_size()))
    losses, grads = [], {}

    def keep():
        if not grads:
            for n, p in engine.module.named_parameters():
                grads[n] = (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()

    for batch in batches(device):
        loss = engine.train_step([batch], lambda mb: engine.criterion(engine(mb), mb), before_optimizer_step=keep)
        losses.append(loss.item())
    weights = full_model_state_dict(engine)
    return {
        "loss_abs": max(abs(a - b) for a, b in zip(losses, ref[0])),
        "grad_abs": _diff(grads, ref[1]),
        "weight_abs": _diff(weights, ref[2]),
    }


def main():
    out = sys.argv[1]
    ctx = kiln.launch_from_torch(seed=0)
    device = ctx.device
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (ctx.world_size,), mesh_dim_names=("cp",))
    ref = reference(device)
    result = {"world_size": ctx.world_size, "direct": direct(device, mesh, ref)}
    if ctx.world_size > 1:
        result["hybrid"] = hybrid(device, ref)
    if ctx.rank == 0:
        with open(os.path.join(out, "cp_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
