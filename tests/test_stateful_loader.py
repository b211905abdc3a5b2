"""Stateful loaders: iterable data resumes mid-epoch from the exact sample, fetching nothing twice.

The end-to-end test SIGKILLs a Trainer that streams an ``IterableDataset`` with ``state_dict``/
``load_state_dict`` through 2 loader workers (the Trainer makes its DataLoader a torchdata
``StatefulDataLoader``) in the middle of its second epoch, and resumes it with ``autoresume``:
every batch trained is the uninterrupted run's, the resumed launch fetches no sample that was
trained before its checkpoint and none twice, and the final weights are bit-exact. Fetches are logged from the worker processes (tests/workers/stream_data.py).
The other tests run in this process: the ResumableLoader's stream state, the replay (and its
warning) of a plain iterable, the world-size guard, ``stateful_dataloader=`` and the YAML key.
"""

from __future__ import annotations

import io
import signal
import subprocess
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from distributed import WORKERS, fork_ranks
from kiln.launch.data import ResumableSampler
from kiln.launch.streaming import as_stateful_dataloader
from workers.stream_data import StatefulStream, Stream, read_fetches

pytest.importorskip("torchdata.stateful_dataloader")
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

RUN = WORKERS / "stream_trainer.py"


def _through_bytes(state):
    """As a checkpoint stores it: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _ids(batches) -> list[list[int]]:
    return [batch[2].tolist() for batch in batches]


# -- end to end: SIGKILL and autoresume ------------------------------------------------------------
def _launch(*runs) -> subprocess.CompletedProcess:
    """One process forked from the tests' warm server (tests/distributed.py: no fresh interpreter's
    torch and kiln imports, ~5 CPU-s each) training ``runs`` (each ``(out, tag, *args)``) one after
    another (``--then``), its loader workers forked from it as in a fresh process."""
    argv = []
    for i, (out, tag, *args) in enumerate(runs):
        out.mkdir(exist_ok=True)
        argv += [*(["--then"] if i else []), str(out), "--tag", tag, *args]
    (done,) = fork_ranks(RUN, lambda rank: {}, nproc=1, args=tuple(argv), timeout=240)
    return done


def _trained(out, tag) -> dict[int, list[int]]:
    """Batch number -> the sample ids it trained on, as the launch ``tag`` logged them."""
    path = out / f"trained_{tag}_rank0.txt"
    if not path.exists():
        return {}
    return {int(b): [int(i) for i in ids] for b, *ids in (line.split() for line in path.read_text().splitlines())}


def test_a_stateful_stream_with_two_workers_killed_mid_epoch_resumes_exactly(tmp_path):
    # 40 samples, 4 a batch: 10 batches an epoch, 2 epochs. The run saves after batch 13 (batch 3
    # of epoch 1) and SIGKILLs itself as batch 16 starts (prefetched by the workers), then resumes in
    # a process of its own. The uninterrupted run goes first in the killed run's process: it reseeds
    # and builds its model, loader and Trainer anew (tests/workers/then_runs.py).
    full_out, out = tmp_path / "full", tmp_path / "run"
    killed = _launch((full_out, "full", "--save-at", "13"), (out, "a0", "--save-at", "13", "--kill-at", "15"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (full_out / "final_full_rank0.pt").exists(), (
        f"the uninterrupted run did not finish:\n{killed.stderr[-3000:]}"
    )
    resumed = _launch((out, "a1", "--save-at", "13", "--autoresume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    full = _trained(full_out, "full")
    assert len(full) == 20 and sorted(sum((full[b] for b in range(1, 11)), [])) == list(range(40))
    assert _trained(out, "a0") == {b: full[b] for b in range(1, 16)}
    assert _trained(out, "a1") == {b: full[b] for b in range(14, 21)}  # from the checkpoint on: the same batches
    fetched = read_fetches(out / "fetched_a1_rank0.txt")
    twice = [key for key, n in Counter(fetched).items() if n > 1]
    assert not twice, f"the resumed run fetched {twice} twice"
    trained_before = {(1, i) for b in range(11, 14) for i in full[b]}  # (epoch, id) up to the checkpoint
    assert not trained_before & set(fetched), "the resumed run fetched samples trained before its checkpoint"
    # it fetched exactly what it trained: the rest of the epoch, 7 batches
    assert sorted(fetched) == sorted((1, i) for b in range(14, 21) for i in full[b]) and len(fetched) == 28
    assert "fetches the" not in resumed.stdout + resumed.stderr  # no replay warning
    final, resumed_final = (
        torch.load(d / f"final_{t}_rank0.pt", weights_only=True) for d, t in ((full_out, "full"), (out, "a1"))
    )
    assert final["loader"] == resumed_final["loader"] == "StatefulDataLoader"  # built for the stateful stream
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, resumed_final["model"][name]), name


# -- the ResumableLoader and a stream, in this process ---------------------------------------------
def _stream_loader(tmp_path, cls=StatefulStream, workers=2, n=24, tag="log"):
    data = cls(n, str(tmp_path / f"{tag}.txt"))
    return kiln.ResumableLoader(as_stateful_dataloader(DataLoader(data, batch_size=3, num_workers=workers), None))


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stream_state_resumes_the_epoch_without_refetching(tmp_path, workers):
    full = _stream_loader(tmp_path, workers=workers, tag="full")
    epoch0, epoch1 = _ids(full), _ids(full)
    assert type(full.loader) is (StatefulDataLoader if workers else DataLoader)  # None: only with workers

    part = _stream_loader(tmp_path, workers=workers, tag="part")
    iterator = iter(part)
    assert _ids(next(iterator) for _ in range(3)) == epoch0[:3]
    saved = _through_bytes(part.state_dict())
    assert saved["stream"]["rank"] == 0 and saved["stream"]["world_size"] == 1
    del iterator

    resumed = _stream_loader(tmp_path, workers=workers, tag="resumed")
    resumed.load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no replay warning
        assert _ids(resumed) == epoch0[3:]
    assert sorted(read_fetches(tmp_path / "resumed.txt")) == sorted((0, i) for b in epoch0[3:] for i in b)
    assert _ids(resumed) == epoch1 and resumed.state_dict().get("stream") is None  # at an epoch's start: none

    # an iterator left unfinished: the next iter() goes on from the stream's own position
    left = _stream_loader(tmp_path, workers=workers, tag="left")
    iterator = iter(left)
    next(iterator), next(iterator)
    del iterator
    assert _ids(left) == epoch0[2:]


def test_a_plain_iterable_replays_the_epochs_start_and_says_how_much(tmp_path):
    full = _stream_loader(tmp_path, cls=Stream, workers=0, tag="full")
    epoch0 = _ids(full)
    part = _stream_loader(tmp_path, cls=Stream, workers=0, tag="part")
    iterator = iter(part)
    next(iterator), next(iterator), next(iterator)
    saved = _through_bytes(part.state_dict())
    assert "stream" not in saved  # nothing to ask: the position is a count of batches
    resumed = _stream_loader(tmp_path, cls=Stream, workers=0, tag="resumed")
    resumed.load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"fetches the 3 batches \(9 samples\) before it again.*state_dict\(\)"):
        assert _ids(resumed) == epoch0[3:]
    fetched = read_fetches(tmp_path / "resumed.txt")
    # 24 fetched to train 15: the 9 the saved run had trained are fetched again
    assert fetched == [(0, i) for batch in epoch0 for i in batch]


def test_a_stream_state_saved_on_another_world_size_falls_back_to_fetching(tmp_path):
    part = _stream_loader(tmp_path, workers=0, tag="part")
    iterator = iter(part)
    next(iterator), next(iterator)
    saved = _through_bytes(part.state_dict())
    saved["stream"]["world_size"] = 2  # as if rank 0 of 2 saved it
    resumed = _stream_loader(tmp_path, workers=0, tag="resumed")
    with pytest.warns(UserWarning, match="saved by rank 0 of 2 and this is rank 0 of 1"):
        resumed.load_state_dict(saved)
    with pytest.warns(UserWarning, match="fetches the 2 batches"):
        assert _ids(resumed) == _ids(_stream_loader(tmp_path, workers=0, tag="full"))[2:]


def test_stateful_dataloader_true_builds_one_and_map_style_data_keeps_kilns_sampler(tmp_path):
    data = TensorDataset(torch.randn(24, 8), torch.randint(0, 2, (24,)))
    model = nn.Linear(8, 2)
    common = dict(max_duration="1ep", criterion=nn.CrossEntropyLoss(), progress_bar=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = kiln.Trainer(
        model,
        train_dataloader=DataLoader(data, batch_size=4, shuffle=True),
        optimizers=optimizer,
        stateful_dataloader=True,
        **common,
    )
    loader = trainer.train_dataloader.loader
    # a ResumableSampler still gives map-style data its position: exact on any world size
    assert type(loader) is StatefulDataLoader and isinstance(loader.sampler, ResumableSampler)
    stream = kiln.Trainer(
        model, train_dataloader=DataLoader(StatefulStream(8, str(tmp_path / "f.txt")), batch_size=4), **common
    )
    assert type(stream.train_dataloader.loader) is DataLoader  # no workers: the dataset holds the state
    with pytest.raises(ValueError, match="stateful_dataloader='yes' must be True, False or None"):
        kiln.Trainer(model, train_dataloader=DataLoader(data), stateful_dataloader="yes", **common)

    # outside the Trainer, torch's RandomSampler becomes torchdata's, whose order a resume keeps
    torch.manual_seed(3)
    shuffled = as_stateful_dataloader(DataLoader(data, batch_size=4, shuffle=True))
    epoch = [batch[1].tolist() for batch in kiln.ResumableLoader(shuffled)]
    torch.manual_seed(3)
    part = kiln.ResumableLoader(as_stateful_dataloader(DataLoader(data, batch_size=4, shuffle=True)))
    iterator = iter(part)
    next(iterator), next(iterator)
    saved = _through_bytes(part.state_dict())
    torch.manual_seed(4)
    resumed = kiln.ResumableLoader(as_stateful_dataloader(DataLoader(data, batch_size=4, shuffle=True)))
    resumed.load_state_dict(saved)
    assert [batch[1].tolist() for batch in resumed] == epoch[2:]


def test_the_yaml_key_reaches_the_trainer(tmp_path):
    from kiln.config import TrainerArgs, build_trainer, check_components

    base = {
        "model": {"type": "torch.nn.Linear", "args": {"in_features": 8, "out_features": 2}},
        "criterion": {"type": "torch.nn.CrossEntropyLoss"},
        "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
        "dataset": {
            "type": "workers.stream_data.StatefulStream",
            "train_args": {"n": 8, "log": str(tmp_path / "f.txt")},
        },
        "dataloader": {"train_args": {"num_workers": 2}},
        "checkpoint": {"no_save": True},
        "micro_batch_size": 4,
        "max_epochs": 1,
        "enable_progress_bar": False,
    }
    for value, expected in ((True, StatefulDataLoader), (None, StatefulDataLoader), (False, DataLoader)):
        args = TrainerArgs.from_dict({**base, "stateful_dataloader": value}).resolve(1)
        check_components(args)
        trainer = build_trainer(args)  # an iterable dataset: no sampler is made for it
        assert trainer.options.data.stateful_dataloader is value
        assert type(trainer.train_dataloader.loader) is expected, value


def test_map_style_data_in_a_stateful_dataloader_resumes_on_another_world_size():
    # a StatefulDataLoader over map-style data keeps kiln's position (the ResumableSampler's), which
    # a world of another size deals out: 2 ranks consumed 8 samples, 1 rank continues after them
    data = TensorDataset(torch.arange(25))

    def loader(num_replicas, rank):
        sampler = ResumableSampler(data, num_replicas=num_replicas, rank=rank, shuffle=True, seed=5)
        return kiln.ResumableLoader(StatefulDataLoader(data, batch_size=2, sampler=sampler, num_workers=2))

    order = [b[0].tolist() for b in loader(1, 0)]
    order = sum(order, [])
    ranks = [loader(2, r) for r in range(2)]
    seen = []
    for ranked in ranks:
        iterator = iter(ranked)
        seen += [i for _ in range(2) for i in next(iterator)[0].tolist()]
    assert sorted(seen) == sorted(order[:8])
    saved = _through_bytes(ranks[0].state_dict())
    assert "stream" not in saved and saved["sample_in_epoch"] == 8
    one = loader(1, 0)
    one.load_state_dict(saved)
    assert sum((b[0].tolist() for b in one), []) == order[8:]
    # and on the same world size (torchdata's own sampler state would start a ResumableSampler over)
    part = loader(1, 0)
    iterator = iter(part)
    next(iterator), next(iterator)
    again = loader(1, 0)
    again.load_state_dict(_through_bytes(part.state_dict()))
    assert sum((b[0].tolist() for b in again), []) == order[4:]
