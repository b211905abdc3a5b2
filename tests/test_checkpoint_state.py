"""What a checkpoint holds, in one process: every save type round-trips the whole training state,
and an interrupted run resumed from a checkpoint ends bit-for-bit where an uninterrupted one does."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.checkpoint import CheckpointSaver, load_checkpoint, save_checkpoint
from workers.ckpt_common import Counter, assert_same, build_state, snapshot, train

SAVE_TYPES = ["sharded", "deduped", "merged"]


@pytest.mark.parametrize("save_type", SAVE_TYPES)
def test_every_part_of_the_state_round_trips(tmp_path, save_type):
    state = build_state(callbacks=[Counter()])
    train(state, 9)  # one epoch (6 batches) and 3 into the next: a mid-epoch checkpoint
    state.engine.micro_step = 0
    path = save_checkpoint(tmp_path, state, save_type)
    expected = snapshot(state)

    restored = build_state(seed=1, callbacks=[Counter()])
    torch.manual_seed(123)  # load must bring back the saved RNG, not keep this one
    manifest = load_checkpoint(path, restored)
    assert manifest["save_type"] == save_type and manifest["timestamp"]["batch"] == 9
    assert_same(expected, snapshot(restored))
    assert restored.callbacks[0].seen == 9
    loader = restored.dataloader  # positioned after 3 batches of epoch 1: the rest follows
    assert (loader.epoch, loader.batch_in_epoch, loader.sample_in_epoch, loader.sampler.seed) == (1, 3, 24, 3)
    assert sum(len(x) for x, _ in loader) == 48 - 3 * 8


def test_grad_scaler_and_accumulation_counter_round_trip(tmp_path):
    state = build_state(precision="amp_fp16")
    train(state, 2)
    state.engine.scaler.update(1234.0)
    state.engine.micro_step = 0
    save_checkpoint(tmp_path, state)
    restored = build_state(seed=1, precision="amp_fp16")
    load_checkpoint("last", restored, folder=tmp_path)
    assert restored.engine.scaler.get_scale() == 1234.0


def test_saving_a_fresh_optimizer_does_not_step_it(tmp_path):
    # DCP's get_state_dict "initialises" an optimizer by stepping it with zero gradients, which
    # would leave Adam's step count at 1 and change the run; kiln saves no optimizer state then.
    state = build_state()
    save_checkpoint(tmp_path, state)
    assert not state.engine.optimizer.state
    assert all(p.grad is None for p in state.model.parameters())
    restored = build_state(seed=1)
    load_checkpoint(tmp_path / "ep0-ba0", restored)
    assert torch.equal(restored.model[0].weight, state.model[0].weight)


@pytest.mark.parametrize("stop_at", [4, 6, 8], ids=["mid-epoch", "epoch-boundary", "next-epoch"])
def test_resume_is_bit_exact(tmp_path, stop_at):
    uninterrupted = build_state()
    train(uninterrupted, 12)
    expected = snapshot(uninterrupted)

    first = build_state(callbacks=[CheckpointSaver(tmp_path, interval="2ba")])
    first.callbacks[0].run_event(kiln.Event.FIT_START, first, None)
    train(first, stop_at)
    del first  # the process "dies" here: nothing of it is used again

    resumed = build_state(seed=7, callbacks=[CheckpointSaver(tmp_path, interval="2ba")])
    torch.manual_seed(99)
    load_checkpoint("last", resumed, folder=tmp_path)
    assert resumed.timestamp.batch.value == stop_at
    train(resumed, 12 - stop_at)
    assert_same(expected, snapshot(resumed))


def test_async_save_holds_the_state_of_when_it_started(tmp_path):
    state = build_state()
    train(state, 3)
    expected = {k: v.clone() for k, v in state.model.state_dict().items()}
    saver = CheckpointSaver(tmp_path, interval="1ba", save_async=True)
    saver.run_event(kiln.Event.FIT_START, state, None)
    saver.save(state)
    with torch.no_grad():  # training goes on while the files are written
        for p in state.model.parameters():
            p.add_(1.0)
    saver.run_event(kiln.Event.FIT_END, state, None)  # waits for the commit
    restored = build_state(seed=1)
    load_checkpoint(tmp_path / "ep0-ba3", restored)
    for key, value in restored.model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert (tmp_path / "last").resolve().name == "ep0-ba3"
