"""`kiln.ResumableLoader` owns the training data position: its state round-trips through plain data
and continues the interrupted epoch exactly (the same order, the RNG as it was, on another world
size every unseen sample once), and checkpoints save and restore it, old ones without it included."""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, TensorDataset

import kiln
from kiln.checkpoint import load_checkpoint, save_checkpoint
from kiln.checkpoint.formats import training_state_file
from kiln.checkpoint.state import restore_training_state
from kiln.launch.data import ResumableSampler
from kiln.launch.rng import rng_state
from workers.ckpt_common import assert_same, build_state, snapshot, train
from workers.ckpt_tamper import rehash


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))  # a sample is its index


def _shuffled(
    n: int = 20, batch_size: int = 4, seed: int = 7, num_replicas: int = 1, rank: int = 0, subset: int | None = None
) -> kiln.ResumableLoader:
    data = _data(n)
    sampler = ResumableSampler(data, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
    return kiln.ResumableLoader(DataLoader(data, batch_size=batch_size, sampler=sampler), subset)


def _indices(batches) -> list[list[int]]:
    return [batch[0].tolist() for batch in batches]


def _take(iterator, n: int) -> list[list[int]]:
    return _indices(next(iterator) for _ in range(n))


def _through_bytes(state: dict) -> dict:
    """A state_dict as a checkpoint stores it: torch.save, then torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _global_order(n: int, seed: int, epoch: int = 0) -> list[int]:
    """The epoch's order on one rank: what every world size's ranks deal out between them."""
    sampler = ResumableSampler(_data(n), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


# -- the loader alone ---------------------------------------------------------------------------
def test_state_round_trip_continues_the_shuffled_epoch_exactly():
    full = _shuffled()
    epoch0, epoch1 = _indices(full), _indices(full)
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == list(range(20))  # shuffled, per epoch

    first = _shuffled()
    assert _take(iter(first), 3) == epoch0[:3]
    saved = _through_bytes(first.state_dict())
    assert {k: v for k, v in saved.items() if k != "rng"} == {
        "epoch": 0,
        "batch_in_epoch": 3,
        "sample_in_epoch": 12,
        "sampler": {"epoch": 0, "skip": 0, "seed": 7, "world_skip": 0},
    }
    assert set(saved["rng"]) >= {"python", "torch"}  # mid-epoch: the RNG states to come back to

    resumed = _shuffled(seed=99)  # the saved sampler seed wins: the order is the saved run's
    resumed.load_state_dict(saved)
    assert len(resumed) == 5 and resumed.dataset is resumed.loader.dataset and resumed.batch_size == 4
    assert _indices(resumed) == epoch0[3:]  # the rest of the epoch, nothing replayed
    assert (resumed.epoch, resumed.batch_in_epoch, resumed.sampler.seed) == (1, 0, 7)
    assert _indices(resumed) == epoch1
    assert resumed.state_dict() == {
        "epoch": 2,
        "batch_in_epoch": 0,
        "sample_in_epoch": 0,
        "sampler": {"epoch": 1, "skip": 0, "seed": 7, "world_skip": 0},
        "rng": None,
    }


def test_an_unfinished_iterator_leaves_the_epoch_unfinished():
    full = _shuffled()
    epoch0 = _indices(full)
    loader = _shuffled()
    assert _take(iter(loader), 2) == epoch0[:2]
    assert _indices(loader) == epoch0[2:]  # a new iter() goes on where the abandoned one stopped
    assert loader.epoch == 1


def test_another_world_size_deals_every_unseen_sample_once():
    n, seed = 25, 5
    order = _global_order(n, seed)
    # 2 ranks, 2 per batch, 2 batches each: the first 8 samples of the epoch's global order
    ranks = [_shuffled(n, 2, seed, num_replicas=2, rank=r) for r in range(2)]
    seen = [_take(iter(loader), 2) for loader in ranks]
    assert sorted(i for batches in seen for b in batches for i in b) == sorted(order[:8])
    saved = _through_bytes(ranks[0].state_dict())
    assert saved["sample_in_epoch"] == 8 and _through_bytes(ranks[1].state_dict())["sample_in_epoch"] == 8

    # 3 ranks: the other 17 dealt round-robin, padded to 18 with the first of them
    three = [_shuffled(n, 3, seed=0, num_replicas=3, rank=r) for r in range(3)]
    for loader in three:
        loader.load_state_dict(saved)
    rest = order[8:] + order[8:9]
    after = [_indices(loader) for loader in three]
    assert [sum(batches, []) for batches in after] == [rest[r::3] for r in range(3)]
    assert Counter(sum(sum(after, []), [])) == Counter(order[8:]) + Counter(order[8:9])


def test_a_resume_after_a_change_of_world_size_continues_from_all_that_was_consumed():
    # The consumed samples stay the start of the epoch's global order across world sizes: after
    # 8 on 2 ranks and one batch of 3 on each of 3 ranks, a resume on 3 ranks continues after 17.
    n, seed = 40, 2
    order = _global_order(n, seed)
    two = _shuffled(n, 2, seed, num_replicas=2, rank=0)
    _take(iter(two), 2)
    three = [_shuffled(n, 3, seed, num_replicas=3, rank=r) for r in range(3)]
    for loader in three:
        loader.load_state_dict(two.state_dict())
    dealt = order[8:] + order[8:9]
    assert [_take(iter(loader), 1)[0] for loader in three] == [dealt[r::3][:3] for r in range(3)]
    saved = three[0].state_dict()
    assert (saved["batch_in_epoch"], saved["sample_in_epoch"]) == (3, 17)
    again = [_shuffled(n, 3, seed, num_replicas=3, rank=r) for r in range(3)]
    for loader in again:
        loader.load_state_dict(saved)
    rest = order[17:] + order[17:18]  # 23 left, padded to 24
    assert [sum(_indices(loader), []) for loader in again] == [rest[r::3] for r in range(3)]


class _Recorded(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n, self.fetched = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.fetched.append(i)
        return torch.tensor(i)


class _Reversed(Sampler[int]):
    """A user's own sampler: no set_epoch, no skip."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


def test_a_loader_without_a_resumable_sampler_skips_by_fetching():
    def loader():
        data = _Recorded(10)
        return kiln.ResumableLoader(DataLoader(data, batch_size=3, sampler=_Reversed(10))), data

    first, _ = loader()
    assert [b.tolist() for b in first] == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [0]]
    part, _ = loader()
    iterator = iter(part)
    next(iterator), next(iterator)
    resumed, data = loader()
    resumed.load_state_dict(_through_bytes(part.state_dict()))
    assert resumed.state_dict()["sample_in_epoch"] == 6  # batches x batch_size, as far as it can tell
    assert [b.tolist() for b in resumed] == [[3, 2, 1], [0]]
    assert data.fetched == list(range(9, -1, -1))  # the first two batches were fetched, to be skipped
    # any iterable of batches, with no len(): the same
    plain = kiln.ResumableLoader(iter([1, 2, 3, 4, 5]))
    plain.load_state_dict({"epoch": 0, "batch_in_epoch": 2, "sample_in_epoch": None, "sampler": None, "rng": None})
    assert list(plain) == [3, 4, 5] and plain.epoch == 1
    with pytest.raises(TypeError, match="has no len"):
        len(plain)


def test_the_subset_ends_each_epoch_and_counts_the_resumed_batches():
    full = _shuffled(40, 4, subset=4)
    assert len(full) == 4 and len(_shuffled(40, 4)) == 10
    epoch0, epoch1 = _indices(full), _indices(full)
    assert len(epoch0) == len(epoch1) == 4 and epoch0 != epoch1
    assert epoch0 == _indices(_shuffled(40, 4))[:4]

    part = _shuffled(40, 4, subset=4)
    _take(iter(part), 2)
    resumed = _shuffled(40, 4, subset=4)
    resumed.load_state_dict(part.state_dict())
    assert _indices(resumed) == epoch0[2:]  # 2 more: 4 in the epoch
    assert _indices(resumed) == epoch1

    at_end = _shuffled(40, 4, subset=4)  # saved after the subset's last batch, before the epoch closed
    _take(iter(at_end), 4)
    resumed = _shuffled(40, 4, subset=4)
    resumed.load_state_dict(at_end.state_dict())
    assert _indices(resumed) == [] and resumed.epoch == 1
    assert _indices(resumed) == epoch1
    with pytest.raises(ValueError, match="subset_num_batches=0"):
        kiln.ResumableLoader([], subset_num_batches=0)


def test_the_rng_is_restored_after_the_first_iter_of_a_resume_and_only_then():
    torch.manual_seed(0)
    full = _shuffled()
    iterator = iter(full)  # draws DataLoader's base seed from torch's RNG
    _take(iterator, 2)
    saved = _through_bytes(full.state_dict())
    after_save = torch.rand(4)  # what the uninterrupted run draws next
    rest = _indices(iterator)
    next_epoch = iter(full)  # draws again: the next epoch's
    after_next_iter = torch.rand(4)

    torch.manual_seed(1)
    resumed = _shuffled()
    resumed.load_state_dict(saved)
    iterator = iter(resumed)
    assert torch.equal(torch.rand(4), after_save)
    assert _indices(iterator) == rest
    assert resumed.state_dict()["rng"] is None  # an epoch's start: nothing to restore
    iter(resumed)  # the next epoch's iter() draws as the uninterrupted one's: not restored again
    assert torch.equal(torch.rand(4), after_next_iter)
    del next_epoch

    # At an epoch's start the uninterrupted run drew iter()'s seed after the saved state too:
    # a position there restores nothing, its iter() draws as a fresh loader's does.
    at_start = _shuffled()
    at_start.load_state_dict({**saved, "batch_in_epoch": 0, "sample_in_epoch": 0})
    torch.manual_seed(2)
    iter(_shuffled())
    expected = torch.rand(4)
    torch.manual_seed(2)
    iter(at_start)
    assert torch.equal(torch.rand(4), expected)


# -- checkpoints --------------------------------------------------------------------------------
def test_a_checkpoint_holds_the_loader_position_as_plain_data(tmp_path):
    state = build_state()
    train(state, 9)  # 6 batches per epoch: 3 into epoch 1
    state.engine.micro_step = 0
    path = save_checkpoint(tmp_path, state)
    saved = torch.load(path / training_state_file(0), weights_only=True)
    assert "sampler" not in saved  # the old key: its state is inside the loader's now
    assert saved["dataloader"] == {
        "epoch": 1,
        "batch_in_epoch": 3,
        "sample_in_epoch": 24,
        "sampler": {"epoch": 1, "skip": 0, "seed": 3, "world_skip": 0},
    }


def _uninterrupted(num_batches: int) -> dict:
    state = build_state()
    train(state, num_batches)
    return snapshot(state)


def test_a_checkpoint_without_the_loader_key_still_resumes_exactly(tmp_path):
    expected = _uninterrupted(12)
    first = build_state()
    train(first, 9)
    first.engine.micro_step = 0
    path = save_checkpoint(tmp_path, first)
    # What a checkpoint written before the loader kept its own state holds: the sampler's state
    # beside the timestamp, and no "dataloader".
    file = path / training_state_file(0)
    saved = torch.load(file, weights_only=True)
    del saved["dataloader"]
    saved["sampler"] = {"epoch": 1, "skip": 0, "seed": 3, "world_skip": 0}
    torch.save(saved, file)
    rehash(path)

    resumed = build_state(seed=7)
    resumed.dataloader.sampler.seed = 11  # the saved seed comes back
    torch.manual_seed(99)
    load_checkpoint(path, resumed)
    loader = resumed.dataloader
    assert (loader.epoch, loader.batch_in_epoch, loader.sample_in_epoch, loader.sampler.seed) == (1, 3, 24, 3)
    train(resumed, 3)
    assert_same(expected, snapshot(resumed))


def _legacy(batch_in_epoch: int, sample_in_epoch: int) -> dict:
    """A saved training state from before the loader's own: the position is the Timestamp's."""
    return {
        "timestamp": {
            "epoch": 0,
            "batch": batch_in_epoch,
            "batch_in_epoch": batch_in_epoch,
            "sample": sample_in_epoch,
            "sample_in_epoch": sample_in_epoch,
        },
        "schedulers": [],
        "rng": rng_state(),
        "sampler": None,
    }


def test_an_old_checkpoint_on_the_same_world_skips_each_ranks_own_batches():
    # A hand-written loop's Timestamp counted one rank's samples (6, not 12): the batches decide.
    n, seed = 25, 5
    order = _global_order(n, seed)
    state = kiln.State(nn.Linear(1, 1))
    state.dataloader = _shuffled(n, 3, seed, num_replicas=2, rank=1)
    restore_training_state(state, _legacy(2, 6), "old.pt", same_world=True)
    assert state.dataloader.sample_in_epoch == 12
    assert sum(_indices(state.dataloader), []) == (order + order[:1])[12:][1::2]


def test_an_old_checkpoint_on_another_world_deals_the_rest_from_the_timestamps_samples():
    n, seed = 25, 5
    order = _global_order(n, seed)
    state = kiln.State(nn.Linear(1, 1))
    state.dataloader = DataLoader(
        _data(n),
        batch_size=3,  # not a ResumableLoader yet: the load wraps it
        sampler=ResumableSampler(_data(n), num_replicas=3, rank=2, shuffle=True, seed=seed),
    )
    # saved by 2 ranks after 2 batches of 2: the Trainer's Timestamp counted both ranks' samples
    restore_training_state(state, _legacy(2, 8), "old.pt", restore_rng=False, same_world=False)
    assert isinstance(state.dataloader, kiln.ResumableLoader) and state.dataloader.sample_in_epoch == 8
    assert sum(_indices(state.dataloader), []) == (order[8:] + order[8:9])[2::3]


def _trainer(loader=None, **kwargs) -> kiln.Trainer:
    kiln.seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 2))
    return kiln.Trainer(
        model,
        train_dataloader=loader,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        seed=3,
        progress_bar=False,
        **kwargs,
    )


def _shuffled_pairs() -> DataLoader:
    g = torch.Generator().manual_seed(4)
    data = TensorDataset(torch.randn(40, 4, generator=g), torch.randint(0, 2, (40,), generator=g))
    return DataLoader(data, batch_size=4, shuffle=True)


def test_a_trainer_without_data_when_it_loads_resumes_with_the_loader_fit_gets(tmp_path):
    full = _trainer(_shuffled_pairs(), max_duration="14ba")
    full.fit()
    first = _trainer(_shuffled_pairs(), max_duration="6ba", save_folder=str(tmp_path), save_interval="3ba")
    first.fit()  # 10 batches per epoch: the checkpoint is mid-epoch
    resumed = _trainer(max_duration="14ba", save_folder=str(tmp_path), load_path="last")
    assert resumed.train_dataloader is None and resumed.state.dataloader.batch_in_epoch == 6
    resumed.fit(train_dataloader=_shuffled_pairs())
    assert resumed.state.dataloader is resumed.train_dataloader and len(resumed.train_dataloader) == 10
    for a, b in zip(full.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)
