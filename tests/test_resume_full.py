"""The Trainer killed hard (``os._exit`` at a chosen batch) and started again with ``autoresume=True``
ends bit-for-bit where an uninterrupted run does, on both of 2 ranks, with the full feature set:
dropout, shuffling, AdamW, warmup + cosine, ``grad_accum=2``, ``amp_bf16``, MixUp and a dataset that
augments with python's, numpy's and torch's RNGs (tests/workers/resume_trainer.py).

One run dies mid-epoch (resumes from the checkpoint after batch 3 of epoch 0), the resumed run dies
again just after an epoch boundary (resumes from the checkpoint at the end of epoch 1), and the third
launch finishes. Every batch each launch trained on must have the uninterrupted run's loss and
augmented input, and the end state (model, optimizer, scheduler, timestamp, RNG states) must match.
The same holds with ``DataLoader(num_workers=2)``, whose workers draw the augmentation (on 1 rank,
and on 2 under zero2).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from distributed import WORKERS, base_env, check, kiln_run

RUN = WORKERS / "resume_trainer.py"


def _launch(out, *args, nproc=2):
    if nproc == 1:
        return subprocess.run(
            [sys.executable, str(RUN), str(out), *args], env=base_env(), capture_output=True, text=True, timeout=600
        )
    return kiln_run(RUN, str(out), *args, nproc=nproc, timeout=600)


def assert_equal(a, b, where):
    """Exact equality of nested checkpoint-like data: torch.equal on every tensor."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _crash_and_resume(out, args, nproc, kills):
    """Launch, dying after each batch in ``kills`` in turn (autoresuming from the second launch on),
    then finish; returns the checkpoint each resume started from."""
    resumed_from = []
    for attempt, die_after in enumerate([*kills, 0]):
        extra = ["--tag", f"attempt{attempt}"] + (["--autoresume"] if attempt else [])
        if attempt:
            resumed_from.append((out / "ckpt/last").resolve().name)
        if die_after:
            died = _launch(out, *args, *extra, "--die-after", str(die_after), nproc=nproc)
            assert died.returncode != 0, died.stderr[-3000:]
        else:
            check(_launch(out, *args, *extra, nproc=nproc))
    return resumed_from


def _assert_resumed_exactly(full, crashed, num_batches, nproc, attempts):
    for rank in range(nproc):
        reference = torch.load(full / f"batches_run_rank{rank}.pt", weights_only=True)
        assert sorted(reference) == list(range(1, num_batches + 1))
        seen = set()
        for attempt in range(attempts):
            batches = torch.load(crashed / f"batches_attempt{attempt}_rank{rank}.pt", weights_only=True)
            for batch, record in batches.items():
                assert_equal(record, reference[batch], f"rank {rank}, launch {attempt}, batch {batch}")
            seen |= set(batches)
        assert seen == set(reference), f"rank {rank}: batches {sorted(set(reference) - seen)} never trained"
        x, y = (torch.load(d / f"final_rank{rank}.pt", weights_only=True) for d in (full, crashed))
        assert x["timestamp"]["batch"] == num_batches
        assert_equal(y, x, f"rank {rank} final")


@pytest.mark.timeout(900)  # four 2-rank launches
@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy, workers", [("ddp", "0"), ("zero2", "2")], ids=["ddp", "zero2-workers"])
def test_two_ranks_killed_mid_epoch_and_at_epoch_boundary_resume_bit_exact(tmp_path, strategy, workers):
    args = ("--strategy", strategy, "--workers", workers)
    check(_launch(tmp_path / "full", *args, "--tag", "run"))
    # 96 samples / (8 per batch * 2 ranks) = 6 batches per epoch; checkpoints at ba3, ba6, ba9, ...
    resumed_from = _crash_and_resume(tmp_path / "crash", args, 2, kills=[4, 13])
    assert resumed_from == ["ep0-ba3", "ep2-ba12"]  # mid-epoch, then an epoch boundary
    _assert_resumed_exactly(tmp_path / "full", tmp_path / "crash", 18, 2, attempts=3)


@pytest.mark.timeout(600)
def test_dataloader_workers_resume_bit_exact(tmp_path):
    # The augmentation runs in 2 loader workers: a resume must give each batch the RNG streams it
    # had in the uninterrupted run, whichever worker fetches it and whatever it fetched before.
    args = ("--workers", "2", "--epochs", "2")
    check(_launch(tmp_path / "full", *args, "--tag", "run", nproc=1))
    resumed_from = _crash_and_resume(tmp_path / "crash", args, 1, kills=[6])
    assert resumed_from == ["ep0-ba3"]
    _assert_resumed_exactly(tmp_path / "full", tmp_path / "crash", 24, 1, attempts=2)


class _Augmented(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i):
        import random

        import numpy as np

        return torch.tensor([float(i), random.random(), float(np.random.rand()), float(torch.rand(()))])


class _BatchFetched(_Augmented):
    def __getitems__(self, indices):  # one call per batch, as datasets with fast batched reads do
        return [self[i] for i in indices]


def test_worker_seeds_depend_on_the_sample_not_the_worker():
    # Loader workers draw each sample's augmentation from seeds of (seed, epoch, rank, position):
    # 1 or 2 workers, and a loader that starts after 8 samples, give the same samples.
    import kiln

    def epoch(num_workers, skip=0, epoch=0, dataset=_Augmented):
        loader = kiln.get_dataloader(dataset(), shuffle=True, seed=3, batch_size=4, num_workers=num_workers)
        loader.sampler.set_epoch(epoch)
        loader.sampler.skip(skip)
        return torch.cat(list(loader))

    two = epoch(2)
    assert sorted(two[:, 0].tolist()) == list(range(24))
    assert torch.equal(epoch(1), two)
    assert torch.equal(epoch(2, skip=8), two[8:])
    assert not torch.equal(epoch(2, epoch=1)[:, 1:].sort(0).values, two[:, 1:].sort(0).values)  # a new epoch, new draws
    assert len(set(two[:, 1].tolist())) == 24  # python's RNG seeded per sample, not once per worker
    batched = epoch(2, dataset=_BatchFetched)  # seeded once per batch, from its first sample's seed
    assert torch.equal(batched[:, 0], two[:, 0]) and torch.equal(epoch(1, dataset=_BatchFetched), batched)
    assert torch.equal(epoch(2, skip=8, dataset=_BatchFetched), batched[8:])
