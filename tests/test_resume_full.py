"""The Trainer killed hard (``os._exit`` at a chosen batch) and started again with ``autoresume=True``
ends bit-for-bit where an uninterrupted run does, on both of 2 ranks, with the full feature set:
dropout, shuffling, AdamW, warmup + cosine, ``grad_accum=2``, ``amp_bf16``, MixUp and a dataset that
augments with python's, numpy's and torch's RNGs (tests/workers/resume_trainer.py).

One run dies mid-epoch (resumes from the checkpoint after batch 3 of epoch 0), the resumed run dies
again just after an epoch boundary (resumes from the checkpoint at the epoch's end), and the third
run finishes. Every batch each run trained on must have the uninterrupted run's loss and augmented
input, and the end state (model, optimizer, scheduler, timestamp, RNG states) must match. The same
holds with ``DataLoader(num_workers=2)``, whose workers draw the augmentation (on 1 rank, and on 2
under zero2).

Each kill ends a launch (ranks forked from the warm server; on 1 rank a forked ``python
resume_trainer.py``), and each resume starts in a new one; the runs that do not die (the
references, the final resumes) ride along in the launch of a run that does, before it.
"""

from __future__ import annotations

import pytest
import torch

from distributed import WORKERS, check, fork_ranks, fork_run

RUN = WORKERS / "resume_trainer.py"


def _launch(argv, nproc):
    if nproc == 1:  # `python resume_trainer.py ...` (no process group), forked from the warm server
        return fork_ranks(RUN, lambda rank: {}, nproc=1, args=tuple(argv), timeout=600)[0]
    return fork_run(RUN, *argv, nproc=nproc, timeout=600)


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


def _chain(root, args, kills):
    """The runs of one scenario, in order: the uninterrupted reference (``root/full``), then a run
    that dies after each batch in ``kills`` in turn (autoresuming from the second on) and one that
    finishes (``root/crash``). Each run is (out, argv, dies)."""
    runs = [(root / "full", [str(root / "full"), *args, "--tag", "run"], False)]
    for attempt, die_after in enumerate([*kills, 0]):
        argv = [str(root / "crash"), *args, "--tag", f"attempt{attempt}"] + (["--autoresume"] if attempt else [])
        runs.append((root / "crash", argv + (["--die-after", str(die_after)] if die_after else []), bool(die_after)))
    return runs


def _run_chains(chains, nproc):
    """Train the runs of every chain (name: runs), each chain's in its order, in as few launches as
    the kills allow: a launch trains the runs at the heads of the chains that finish, then at most
    one run that dies (its os._exit ends the launch's processes). Each run starts from
    seed_everything(0) and a new Trainer; a resumed run only starts in a launch after the one its
    chain's last run died in, so it reads what a killed process left on disk. Returns, per chain,
    the checkpoint each autoresumed run started from."""
    todo = {name: list(runs) for name, runs in chains.items()}
    resumed_from = {name: [] for name in chains}
    while any(todo.values()):
        launch = []
        for name, runs in todo.items():
            while runs and not runs[0][2]:
                launch.append((name, runs.pop(0)))
        dying = next((name for name, runs in todo.items() if runs), None)
        if dying is not None:
            launch.append((dying, todo[dying].pop(0)))
        for name, (out, argv, _) in launch:
            out.mkdir(parents=True, exist_ok=True)
            if "--autoresume" in argv:
                resumed_from[name].append((out / "ckpt/last").resolve().name)
        argv = [arg for i, (_, (_, run, _)) in enumerate(launch) for arg in (["--then"] if i else []) + run]
        result = _launch(argv, nproc)
        if launch[-1][1][2]:
            assert result.returncode != 0, result.stderr[-3000:]
            for _, (out, _, _) in launch[:-1]:  # the runs before the one that died finished
                assert (out / "final_rank0.pt").exists(), f"{out} did not finish:\n{result.stderr[-3000:]}"
        else:
            check(result)
    return resumed_from


def _assert_resumed_exactly(full, crashed, num_batches, nproc, attempts):
    for rank in range(nproc):
        reference = torch.load(full / f"batches_run_rank{rank}.pt", weights_only=True)
        assert sorted(reference) == list(range(1, num_batches + 1))
        seen = set()
        for attempt in range(attempts):
            batches = torch.load(crashed / f"batches_attempt{attempt}_rank{rank}.pt", weights_only=True)
            for batch, record in batches.items():
                assert_equal(record, reference[batch], f"rank {rank}, attempt {attempt}, batch {batch}")
            seen |= set(batches)
        assert seen == set(reference), f"rank {rank}: batches {sorted(set(reference) - seen)} never trained"
        x, y = (torch.load(d / f"final_rank{rank}.pt", weights_only=True) for d in (full, crashed))
        assert x["timestamp"]["batch"] == num_batches
        assert_equal(y, x, f"rank {rank} final")


# The two 2-rank scenarios: DDP, and ZeRO-2 with loader workers drawing the augmentation; 2 epochs
# (the second kill lands just after the first epoch's end).
SCENARIOS = {
    "ddp": ("--strategy", "ddp", "--workers", "0", "--epochs", "2"),
    "zero2-workers": ("--strategy", "zero2", "--workers", "2", "--epochs", "2"),
}


@pytest.fixture(scope="module")
def two_rank_chains(tmp_path_factory):
    """Both 2-rank scenarios' runs (killed after batches 4 and 7), in 5 launches rather than 8:
    the references and the runs that finish share the launches of runs that die."""
    root = tmp_path_factory.mktemp("two_ranks")
    chains = {name: _chain(root / name, args, kills=[4, 7]) for name, args in SCENARIOS.items()}
    return root, _run_chains(chains, nproc=2)


@pytest.mark.timeout(900)  # five 2-rank launches, for both scenarios
@pytest.mark.world_size(2)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_killed_mid_epoch_and_at_epoch_boundary_resume_bit_exact(two_rank_chains, scenario):
    root, resumed_from = two_rank_chains
    # 96 samples / (8 per batch * 2 ranks) = 6 batches per epoch; checkpoints at ba3, ba6, ba9, ...
    assert resumed_from[scenario] == ["ep0-ba3", "ep1-ba6"]  # mid-epoch, then an epoch boundary
    _assert_resumed_exactly(root / scenario / "full", root / scenario / "crash", 12, 2, attempts=3)


@pytest.mark.timeout(600)
def test_dataloader_workers_resume_bit_exact(tmp_path):
    # The augmentation runs in 2 loader workers: a resume must give each batch the RNG streams it
    # had in the uninterrupted run, whichever worker fetches it and whatever it fetched before.
    args = ("--workers", "2", "--epochs", "2")
    resumed_from = _run_chains({"workers": _chain(tmp_path, args, kills=[6])}, nproc=1)["workers"]
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
