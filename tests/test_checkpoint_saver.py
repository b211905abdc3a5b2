"""CheckpointSaver policy: intervals in every form, the final checkpoint, retention, save_best."""

from __future__ import annotations

import os

import pytest

import kiln
from kiln.checkpoint import CheckpointSaver, verify_checkpoint
from workers.ckpt_common import build_state, train


def _run(tmp_path, num_batches=10, max_duration=None, metrics=None, **saver_args):
    saver = CheckpointSaver(tmp_path, **saver_args)
    state = build_state(callbacks=[saver])  # 6 batches of 8 samples per epoch
    state.max_duration = max_duration
    saver.run_event(kiln.Event.FIT_START, state, None)
    train(state, num_batches, on_batch=metrics)
    saver.run_event(kiln.Event.FIT_END, state, None)
    return sorted(p.name for p in tmp_path.iterdir()), saver, state


@pytest.mark.parametrize(
    "args, expected",
    [
        ({"interval": "3ba"}, ["ep0-ba3", "ep0-ba6", "ep1-ba9", "ep1-ba10"]),
        ({"interval": 1}, ["ep1-ba6", "ep1-ba10"]),
        ({"interval": "36sp"}, ["ep0-ba5", "ep1-ba9", "ep1-ba10"]),  # 8 samples a batch: 40 and 72 cross 36, 72
        ({"interval": "0.5dur", "max_duration": kiln.Time(10, "ba")}, ["ep0-ba5", "ep1-ba10"]),
        ({"interval": lambda state, event: state.timestamp.batch.value == 2}, ["ep0-ba2", "ep1-ba10"]),
        ({"every_n_train_steps": 4, "every_n_epochs": 1}, ["ep0-ba4", "ep1-ba6", "ep1-ba8", "ep1-ba10"]),
    ],
    ids=["batches", "epochs", "samples", "fraction", "callable", "nnscaler-form"],
)
def test_intervals_and_the_final_checkpoint(tmp_path, args, expected):
    max_duration = args.pop("max_duration", None)
    names, _, _ = _run(tmp_path, max_duration=max_duration, **args)
    assert names == sorted([*expected, "last"])
    assert os.readlink(tmp_path / "last") == expected[-1]


def test_retention_and_best(tmp_path):
    losses = {2: 0.9, 4: 0.3, 6: 0.5, 8: 0.7, 10: 0.6}

    def evaluate(state):  # an evaluation after some batches, as the Trainer runs it
        if state.timestamp.batch.value in losses:
            state.metrics["eval/loss"] = losses[state.timestamp.batch.value]
            for cb in state.callbacks:
                cb.run_event(kiln.Event.EVAL_END, state, None)

    names, saver, _ = _run(tmp_path, metrics=evaluate, interval="2ba", num_checkpoints_to_keep=2, save_best="eval/loss")
    assert os.readlink(tmp_path / "best") == "ep0-ba4" and saver.best_value == 0.3
    assert names == sorted(["best", "ep0-ba4", "ep1-ba8", "ep1-ba10", "last"])
    for name in ("best", "last"):
        verify_checkpoint(tmp_path / name)


def test_best_saves_a_checkpoint_when_none_exists_at_that_step(tmp_path):
    def evaluate(state):
        if state.timestamp.batch.value == 3:
            state.metrics["eval/Accuracy"] = 0.8
            for cb in state.callbacks:
                cb.run_event(kiln.Event.EVAL_END, state, None)

    names, _, _ = _run(tmp_path, num_batches=5, metrics=evaluate, interval="1ep", save_best=("eval/Accuracy", "max"))
    assert names == ["best", "ep0-ba3", "ep0-ba5", "last"] and os.readlink(tmp_path / "best") == "ep0-ba3"


def test_async_saves_commit_and_keep_order(tmp_path):
    names, _, _ = _run(tmp_path, interval="2ba", save_async=True, num_checkpoints_to_keep=2)
    assert names == sorted(["ep1-ba8", "ep1-ba10", "last"])
    assert os.readlink(tmp_path / "last") == "ep1-ba10"
    verify_checkpoint(tmp_path / "last")


@pytest.mark.parametrize(
    "args, words",
    [
        ({"interval": "often"}, "not a save interval"),
        ({"interval": "0ba"}, "must be positive"),
        ({"save_type": "zip"}, "save_type='zip' is not known"),
        ({"save_type": "merged", "save_async": True}, "save_async=True needs"),
        ({"num_checkpoints_to_keep": 0}, "-1 \\(keep all\\) or an int >= 1"),
        ({"every_n_train_steps": 0}, "every_n_train_steps=0 must be a positive int"),
        ({"save_best": ("eval/loss", "lowest")}, "'min' \\| 'max'"),
        ({"preemption_signals": ("SIGNOPE",)}, "SIGNOPE"),
    ],
)
def test_bad_arguments_say_what_to_do(tmp_path, args, words):
    with pytest.raises(ValueError, match=words):
        CheckpointSaver(tmp_path, **args)
