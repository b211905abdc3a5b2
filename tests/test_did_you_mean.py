"""Misspelt strategy, precision and optimizer names: the Python API says "did you mean" as the YAML does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.config.compute import ComputeConfig
from kiln.config.overrides import ConfigError
from kiln.core.names import close_match, did_you_mean


def _trainer(**kwargs):
    return kiln.Trainer(nn.Linear(2, 2), criterion=nn.MSELoss(), progress_bar=False, **kwargs)


def test_python_strategy_gets_the_yaml_s_suggestion():
    with pytest.raises(ConfigError, match=r"\(did you mean 'fsdp'\?\)$"):
        ComputeConfig(strategy="fsdp3").strategy_name("autodist", 2)
    with pytest.raises(
        ValueError, match=r"^strategy='fsdp3' is not known; expected one of .*\(did you mean 'fsdp'\?\)$"
    ):
        _trainer(strategy="fsdp3")
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"\(did you mean 'zero2'\?\)$"):
        kiln.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"strategy": "zer02"})


@pytest.mark.parametrize(
    "precision, match",
    [("amp_bf61", "amp_bf16"), ("bf61", "bf16"), ({"parm": "bf16"}, "param"), ({"param": "bf61"}, "bf16")],
)
def test_python_precision_names_get_a_suggestion(precision, match):
    with pytest.raises(ValueError, match=rf"\(did you mean '{match}'\?\)$"):
        _trainer(precision=precision)


@pytest.mark.parametrize(
    "name, match", [("adamw", "AdamW"), ("Adamw", "AdamW"), ("sgd", "SGD"), ("torch.optim.Adamm", "Adam")]
)
def test_an_optimizer_name_gets_the_class_the_yaml_would_suggest(name, match):
    with pytest.raises(
        ValueError,
        match=rf"^optimizers='{name}' is a name, not an optimizer; .*\(did you mean 'torch\.optim\.{match}'\?\)$",
    ):
        _trainer(optimizers=name)


def test_no_suggestion_when_nothing_is_close():
    assert did_you_mean("lion", ["AdamW", "SGD"], fold_case=True) == ""
    assert close_match("ADAMW", ["AdamW", "SGD"], fold_case=True) == "AdamW" and close_match("ADAMW", ["AdamW"]) is None
    with pytest.raises(ValueError) as info:
        _trainer(strategy="megatron")
    assert "did you mean" not in str(info.value)
