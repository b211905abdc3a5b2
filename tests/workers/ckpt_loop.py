"""A hand-written loop on kiln's State + Engine + CheckpointSaver, for resume and preemption tests.

    python ckpt_loop.py OUT [--epochs 2] [--interval 2ba] [--die-after N] [--sigterm-after N]
                            [--resume] [--save-type sharded] [--async] [--strategy auto]

Everything a resume can get wrong is in it: dropout, a shuffled resumable sampler, AdamW, a
warmup+cosine schedule, two microbatches per step, amp_bf16 autocast, and an algorithm that draws
from python's, numpy's and torch's global RNGs. ``--die-after N`` ends the process with
``os._exit`` after batch N (no cleanup at all); the final model and optimizer go to
``OUT/final_rank<r>.pt``.

``--then`` starts the arguments of another run, trained after this one in the same process (and
process group), from the same seeds with a new model, optimizer, loader and saver: one launch pays
the interpreter and process-group start-up once for several runs. Only the last run may
``--die-after`` or ``--sigterm-after`` (they end the process).
"""

import argparse
import math
import os
import signal
import sys

import torch
from torch import nn

import kiln
from kiln.checkpoint import CheckpointSaver, load_checkpoint
from kiln.launch.data import ResumableSampler
from then_runs import split_runs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ckpt_common import Noise  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--interval", default="2ba")
p.add_argument("--die-after", type=int, default=0)
p.add_argument("--sigterm-after", type=int, default=0)
p.add_argument("--sigterm-rank", type=int, default=0)
p.add_argument("--resume", action="store_true")
p.add_argument("--save-type", default="sharded")
p.add_argument("--async", dest="save_async", action="store_true")
p.add_argument("--strategy", default="auto")
p.add_argument("--keep", type=int, default=-1)


RUNS = split_runs(p, sys.argv[1:], "die_after", "sigterm_after")
ctx = kiln.launch_from_torch(seed=0) if "RANK" in os.environ else kiln.launch(seed=0)


def run(args: argparse.Namespace) -> None:
    kiln.seed_everything(0)  # each run from the seeds the launch set for the first
    torch.manual_seed(0)

    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    total_steps = args.epochs * 12 // ctx.world_size
    schedule = lambda s: min(1.0, (s + 1) / 3) * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    engine = kiln.Engine(model, optimizer, nn.CrossEntropyLoss(), precision="amp_bf16", strategy=args.strategy)
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g))
    sampler = ResumableSampler(data, shuffle=True, seed=3)
    loader = kiln.ResumableLoader(torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler))

    saver = CheckpointSaver(
        f"{args.out}/ckpt",
        interval=args.interval,
        save_type=args.save_type,
        save_async=args.save_async,
        num_checkpoints_to_keep=args.keep,
    )
    jitter = Noise()  # draws from all three global RNGs; its call count is checkpointed
    state = kiln.State(
        model,
        rank=ctx.rank,
        world_size=ctx.world_size,
        optimizers=[optimizer],
        schedulers=[scheduler],
        algorithms=[jitter],
        callbacks=[saver],
    )
    state.engine, state.dataloader = engine, loader
    if args.resume:
        load_checkpoint("last", state, folder=f"{args.out}/ckpt")

    ts = state.timestamp
    saver.run_event(kiln.Event.FIT_START, state, None)
    while ts.epoch.value < args.epochs and not state.stopped:
        # The loader sets the sampler's epoch, continues a resumed one after what it consumed and puts
        # back the RNG states that DataLoader.__iter__ drew from.
        for batch in loader:
            state.batch = batch
            jitter.apply(kiln.Event.AFTER_DATALOADER, state, None)
            x, y = state.batch
            engine.train()
            engine.zero_grad()
            for xm, ym in zip(x.chunk(2), y.chunk(2)):
                engine.backward(engine.criterion(engine(xm), ym), weight=len(xm) / len(x))
            engine.optimizer_step()
            scheduler.step()
            ts.advance_batch(len(x))
            saver.run_event(kiln.Event.BATCH_CHECKPOINT, state, None)
            if args.die_after and ts.batch.value == args.die_after:
                os._exit(17)  # a hard crash: no finally blocks, no flushing, nothing
            if args.sigterm_after and ts.batch.value == args.sigterm_after and ctx.rank == args.sigterm_rank:
                os.kill(os.getpid(), signal.SIGTERM)
            if state.stopped:
                break
        else:
            ts.advance_epoch()
            saver.run_event(kiln.Event.EPOCH_CHECKPOINT, state, None)

    try:
        saver.run_event(kiln.Event.FIT_END, state, None)
    except SystemExit as exc:  # the preemption exit, status 75
        if exc.code:
            # The checkpoint is committed and this rank's status decided. kiln's handler is gone
            # (Preempted uninstalls it), so the SIGTERM with which a launcher (torchrun's agent,
            # tests/distributed.py's fork jobs) stops the ranks left once a peer has exited 75
            # would kill this one by the signal (-15) while the interpreter shuts down.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            raise
    final = kiln.parallel.state.dcp_state.get_state_dict(engine.model, optimizer, full=True)
    torch.save(
        {
            **final,
            "calls": jitter.calls,
            "lr": scheduler.get_last_lr(),
            "batch": ts.batch.value,
            "rng": torch.get_rng_state(),
        },
        f"{args.out}/final_rank{ctx.rank}.pt",
    )


for args in RUNS:
    run(args)
