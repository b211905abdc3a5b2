"""The Trainer's arguments: keyword-only after ``model``, grouped option dataclasses checked in
``__post_init__`` (so a bad value fails at construction, in one line naming it), each rule once."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import kiln
from kiln.trainer.options import (
    CheckpointOptions,
    DurationOptions,
    EvalOptions,
    LogOptions,
    MicrobatchOptions,
    TrainerOptions,
)


def _loader():
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    return torch.utils.data.DataLoader(data, batch_size=8)


def _trainer(**kwargs):
    model = nn.Linear(4, 2)
    args = dict(
        train_dataloader=_loader(),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), 0.1),
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
    )
    args.update(kwargs)
    return kiln.Trainer(model, **args)


def test_every_argument_after_model_is_keyword_only():
    params = list(inspect.signature(kiln.Trainer).parameters.values())
    assert params[0].name == "model" and params[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:])
    with pytest.raises(TypeError, match="positional"):
        kiln.Trainer(nn.Linear(4, 2), _loader())  # type: ignore[misc]  # the wrong call under test


def test_colossal_positional_engine_is_the_engine():
    model = nn.Linear(4, 2)
    engine = kiln.Engine(model, torch.optim.SGD(model.parameters(), 0.1), nn.CrossEntropyLoss(), strategy="single")
    trainer = kiln.Trainer(engine, train_dataloader=_loader(), max_duration="1ba", progress_bar=False)
    assert trainer.engine is engine
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grad_accum": 0}, r"^grad_accum=0 must be an integer >= 1$"),
        ({"grad_accum": True}, r"^grad_accum=True must be an integer >= 1$"),
        (
            {"device_train_microbatch_size": "big"},
            r"^device_train_microbatch_size='big' must be an integer >= 1, or 'auto'$",
        ),
        (
            {"grad_accum": 2, "device_train_microbatch_size": 4},
            r"^grad_accum=2 and device_train_microbatch_size=4 both split batches; set one of them$",
        ),
        ({"max_duration": "0.5dur"}, r"^max_duration='0.5dur' cannot be a fraction of itself"),
        ({"max_duration": 0}, r"^max_duration=0 must be positive$"),
        ({"scale_schedule_ratio": 0}, r"^scale_schedule_ratio=0 must be a positive number$"),
        ({"train_subset_num_batches": 0}, r"^train_subset_num_batches=0 must be an integer >= 1, or -1/None"),
        ({"eval_interval": "3sp"}, r"^eval_interval='3sp' must be a positive number of epochs"),
        ({"eval_subset_num_batches": -2}, r"^eval_subset_num_batches=-2 must be an integer >= 1, or None$"),
        ({"log_interval": "1ep"}, r"^log_interval='1ep' must be a positive number of batches"),
        ({"console_interval": "1ep"}, r"^console_interval='1ep' must be a wall-clock time like '30s' or '5m'"),
        ({"console_interval": 0}, r"^console_interval=0 must be a wall-clock time like '30s'"),
        (
            {"save_num_checkpoints_to_keep": 0},
            r"^save_num_checkpoints_to_keep=0 must be -1 \(keep all\) or an int >= 1$",
        ),
        ({"save_type": "pickle"}, r"save_type='pickle'"),
        ({"autoresume": True}, r"^autoresume=True needs save_folder="),
    ],
)
def test_a_bad_argument_fails_at_construction_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        _trainer(**kwargs)
    assert "\n" not in str(info.value)


def test_groups_validate_on_their_own_and_normalise():
    assert DurationOptions("2ep", scale_schedule_ratio=1.5).max_duration == kiln.Time(3, kiln.TimeUnit.EPOCH)
    assert DurationOptions(train_subset_num_batches=-1).train_subset_num_batches is None
    micro = MicrobatchOptions(device_train_microbatch_size="auto")
    assert micro.auto_microbatch and micro.splits_batches and micro.microbatch_size(10) == 10
    assert MicrobatchOptions(grad_accum=3).microbatch_size(10) == 4
    assert EvalOptions("100ba").eval_interval == kiln.Time(100, kiln.TimeUnit.BATCH)
    assert LogOptions(None, "5ba").log_every == 5 and LogOptions(None).loggers == []
    assert LogOptions(console_interval="2m").console_interval == kiln.Time(120, kiln.TimeUnit.SECOND)
    assert LogOptions(console_interval=None).console_interval is None
    with pytest.raises(ValueError, match="console_interval='1ep'"):
        LogOptions(console_interval="1ep")
    with pytest.raises(ValueError, match="grad_accum=-1"):
        MicrobatchOptions(grad_accum=-1)
    with pytest.raises(ValueError, match="autoresume=True needs save_folder="):
        CheckpointOptions(autoresume=True)


def test_the_trainer_keeps_its_arguments_by_group():
    trainer = _trainer(grad_accum=2, eval_subset_num_batches=3, log_interval="2ba", save_type="deduped")
    opts = trainer.options
    assert isinstance(opts, TrainerOptions)
    assert opts.microbatching.grad_accum == 2 and opts.evaluation.eval_subset_num_batches == 3
    assert opts.logging.log_every == 2 and opts.checkpointing.save_type == "deduped"
    assert opts.duration.max_duration == kiln.Time(1, kiln.TimeUnit.BATCH)


def test_the_retention_rule_is_the_checkpoint_layers():
    # the Trainer and the CheckpointSaver give the same rule, each naming its own argument
    with pytest.raises(ValueError, match=r"^num_checkpoints_to_keep=0 must be -1 \(keep all\) or an int >= 1$"):
        kiln.checkpoint.CheckpointSaver("unused", num_checkpoints_to_keep=0)
    with pytest.raises(ValueError, match=r"^save_num_checkpoints_to_keep=False must be -1"):
        _trainer(save_num_checkpoints_to_keep=False)
