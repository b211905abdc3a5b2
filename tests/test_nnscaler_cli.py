"""nnScaler's command-line corners in ``kiln train`` (issue 34): bare boolean flags, ``__value_type``
values that only their type converts, and a ``vars:`` section overridden from the command line.

Every expected value is what nnScaler's ``TrainerArgs.from_cli`` gives for the same YAML and argv
(its ``parse_args``, ``merge_args``, ``resolve_args`` and ``deserialize_dataclass``): references
are resolved on the text as typed, and each field converts that text by its own type.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from kiln.config.args import dump_yaml, load_trainer_args, typed_overrides
from kiln.config.build import build_value
from kiln.config.overrides import CommandLineText, ConfigError, resolve_references
from kiln.config.types import settle_text

ROOT = Path(__file__).resolve().parents[1]

# nnScaler's own tests/cli/trainer_args.yaml, with kiln's example model and dataset.
RUN_YAML = """\
vars:
  dim: 16
  drop_last: true
  tag: small
  model: {nlayers: 2}
  sizes: [100, 10]
  b1: 0.9
model:
  type: examples.mlp_model.MLP
  args: {dim: $(vars.dim), nlayers: $(vars.model.nlayers)}
optimizer:
  type: torch.optim.Adam
  args: {lr: 0.01, betas: [$(vars.b1), 0.99]}
dataset:
  type: examples.mlp_model.RandomDataset
  train_args: {dim: $(vars.dim), size: $(vars.sizes.0)}
  val_args: {dim: $(vars.dim), size: $(vars.sizes.1)}
dataloader:
  train_args: {drop_last: $(vars.drop_last)}
instance_name: run-$(vars.tag)-$(vars.dim)
micro_batch_size: 2
max_train_steps: 10
enable_progress_bar: false
"""


def _args(argv, text=RUN_YAML, **changes):
    cfg = yaml.safe_load(text)
    cfg.update(changes)
    return load_trainer_args(cfg, argv, world_size=1, check=False)


# ---- 1. bare boolean flags ----------------------------------------------------------------------


def test_bare_flag_at_the_end_or_before_another_flag_is_true():
    assert typed_overrides(["--enable_progress_bar"]) == [("enable_progress_bar", True, False)]
    assert typed_overrides(["--enable_progress_bar", "--max_epochs", "3", "--checkpoint.no_save"]) == [
        ("enable_progress_bar", True, False),
        ("max_epochs", 3, False),
        ("checkpoint.no_save", True, False),
    ]
    args = _args(["--enable_progress_bar", "--compute_config.use_zero", "--checkpoint.no_save"])
    assert (args.enable_progress_bar, args.compute_config.use_zero, args.checkpoint.no_save) == (True, True, True)
    # bool | None (stateful_dataloader) and bool | mapping (compile, float8) are flags too
    args = _args(["--stateful_dataloader", "--compile", "--max_train_steps", "4"])
    assert (args.stateful_dataloader, args.compile, args.max_train_steps) == (True, True, 4)


@pytest.mark.parametrize(
    ("text", "expected"), [("0", False), ("1", True), ("TRUE", True), ("False", False), ("true", True)]
)
def test_boolean_field_reads_nnscalers_words(text, expected):
    # nnScaler: 'true'/'1' and 'false'/'0' in any case (a guess first made '0' the int 0, refused)
    assert _args(["--enable_progress_bar", text]).enable_progress_bar is expected
    assert _args(["--compile", text]).compile is expected


def test_bare_key_that_is_no_boolean_is_an_error():
    with pytest.raises(ConfigError) as info:
        _args(["--micro_batch_size", "--enable_progress_bar"])
    assert str(info.value) == (
        "micro_batch_size: no value given for '--micro_batch_size', expected --micro_batch_size VALUE, "
        "--micro_batch_size=VALUE or --micro_batch_size! to delete the key"
    )
    with pytest.raises(ConfigError) as info:
        _args(["--enable_progress_bar", "yes"])
    assert str(info.value) == "enable_progress_bar: got 'yes' (str), expected true or false"


# ---- 2. __value_type: only that type converts the value -----------------------------------------


def test_value_type_converts_the_text_as_typed():
    argv = ["--instance_name.__value_type", "str", "--instance_name.value", "1e3"]
    assert _args(argv).instance_name == "1e3"
    argv = ["--model.args.tag.value", "1e3", "--model.args.tag.__value_type", "str"]  # either order
    assert _args(argv).model.args["tag"] == {"__value_type": "str", "value": "1e3"}
    assert build_value(_args(argv).model.args)["tag"] == "1e3"
    argv = ["--model.args.tag.__value_type", "float", "--model.args.tag.value", "1e3"]
    assert build_value(_args(argv).model.args)["tag"] == 1000.0


def test_value_type_of_a_var_from_the_command_line_is_not_guessed_first():
    # the value reaches __value_type through a reference: still str('1e3'), not str(1000.0)
    argv = ["--vars.v", "1e3"]
    instance = {"__value_type": "str", "value": "$(vars.v)"}
    assert _args(argv, instance_name=instance).instance_name == "1e3"
    args = _args(argv, model={"type": "examples.mlp_model.MLP", "args": {"tag": instance, "n": "$(vars.v)"}})
    assert args.model.args == {"tag": {"__value_type": "str", "value": "1e3"}, "n": 1000.0}
    assert build_value(args.model.args) == {"tag": "1e3", "n": 1000.0}
    assert type(args.model.args["tag"]["value"]) is str  # no CommandLineText left in the arguments


# ---- 3. vars: resolved after files and overrides -------------------------------------------------


def test_vars_resolve_like_nnscalers_example_yaml():
    args = _args([])
    assert args.model.args == {"dim": 16, "nlayers": 2}
    assert args.dataset.train_args == {"dim": 16, "size": 100} and args.dataset.val_args == {"dim": 16, "size": 10}
    assert args.dataloader.train_args == {"drop_last": True}
    assert args.optimizer.args == {"lr": 0.01, "betas": [0.9, 0.99]}
    assert args.instance_name == "run-small-16"


def test_overriding_a_var_changes_every_reference():
    args = _args(["--vars.dim", "22", "--vars.drop_last", "false", "--vars.model.nlayers", "3", "--vars.sizes.1", "7"])
    assert args.model.args == {"dim": 22, "nlayers": 3}
    assert args.dataset.train_args == {"dim": 22, "size": 100} and args.dataset.val_args == {"dim": 22, "size": 7}
    assert args.dataloader.train_args == {"drop_last": False}
    assert args.instance_name == "run-small-22"
    assert _args(["--vars.b1", "0.8"]).optimizer.args == {"lr": 0.01, "betas": [0.8, 0.99]}
    # a var the YAML does not have, and one that references another key (nnScaler's --vars.hello)
    args = _args(["--vars.steps", "5", "--vars.hello", "p$(micro_batch_size)"], max_train_steps="$(vars.steps)")
    assert (args.max_train_steps, type(args.max_train_steps)) == (5, int)
    assert _args(["--vars.hello", "p$(micro_batch_size)"], instance_name="$(vars.hello)").instance_name == "p2"


@pytest.mark.parametrize(
    ("text", "interpolated", "whole"),
    [
        ("1e3", "run-1e3-16", "1e3"),
        ("123", "run-123-16", "123"),
        ("true", "run-true-16", "true"),
        ("007", "run-007-16", "007"),
    ],
)
def test_a_var_from_the_command_line_is_its_text_where_text_is_wanted(text, interpolated, whole):
    # nnScaler resolves references on the text as typed; the str field converts it: '1e3', not '1000.0'
    assert _args(["--vars.tag", text]).instance_name == interpolated
    assert _args(["--vars.tag", text], instance_name="$(vars.tag)").instance_name == whole
    assert _args(["--vars.tag", text], checkpoint={"save_dir": "$(vars.tag)"}).checkpoint.save_dir == whole


def test_a_var_from_the_command_line_takes_the_type_of_the_field_it_reaches():
    assert _args(["--vars.pb", "0"], enable_progress_bar="$(vars.pb)").enable_progress_bar is False
    assert _args(["--vars.pb", "TRUE"], enable_progress_bar="$(vars.pb)").enable_progress_bar is True
    assert _args(["--vars.name", "null"], instance_name="$(vars.name)").instance_name is None
    assert _args(
        ["--vars.lr", "1e-3"], optimizer={"type": "torch.optim.Adam", "args": {"lr": "$(vars.lr)"}}
    ).optimizer.args == {"lr": 0.001}
    with pytest.raises(ConfigError) as info:
        _args(["--vars.steps", "five"], max_train_steps="$(vars.steps)")
    assert str(info.value) == "max_train_steps: got 'five' (str), expected an int or null"


def test_settle_text_by_annotation():
    assert settle_text(CommandLineText("1e3"), str) == "1e3"
    assert type(settle_text(CommandLineText("1e3"), str)) is str
    assert settle_text("None", str | None) is None and settle_text("None", str) == "None"
    assert settle_text("0", bool) is False and settle_text("1", bool | None) is True
    assert settle_text("1", int) == 1 and settle_text("1e3", float) == 1000.0
    assert settle_text("[1, 2]", list[int]) == [1, 2]


def test_escaped_references_stay_text():
    assert _args([], instance_name="$$(vars.dim)").instance_name == "$(vars.dim)"  # nnScaler's later escape
    assert _args([], instance_name="$\\(vars.dim)").instance_name == "$(vars.dim)"  # its first one
    assert _args([], instance_name="a$${vars.dim}b-$(vars.dim)").instance_name == "a${vars.dim}b-16"
    assert resolve_references({"a": "$$x", "b": "$$!(vars.x)"}, environ=None) == {"a": "$$x", "b": "$$!(vars.x)"}


def test_vars_are_dropped_from_the_printed_config_which_reads_back_the_same():
    args = _args(["--vars.dim", "22", "--vars.tag", "1e3"])
    printed = yaml.safe_load(dump_yaml(args))
    assert "vars" not in printed
    assert printed["instance_name"] == "run-1e3-22" and printed["model"]["args"] == {"dim": 22, "nlayers": 2}
    assert load_trainer_args(printed, world_size=1, check=False) == args


def test_deleting_or_breaking_vars_is_one_line_naming_the_reference():
    with pytest.raises(ConfigError) as info:
        _args(["--vars!"])
    assert str(info.value) == (
        "model.args.dim: reference '$(vars.dim)' cannot be resolved: vars: unknown key 'vars' in the config"
    )
    with pytest.raises(ConfigError) as info:
        _args([], instance_name="$(vars.tga)")
    assert str(info.value) == (
        "instance_name: reference '$(vars.tga)' cannot be resolved: vars.tga: unknown key 'tga' in vars"
        " (did you mean 'tag'?)"
    )


def test_kiln_train_print_config(tmp_path, monkeypatch, capsys):
    from kiln.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    (tmp_path / "run.yaml").write_text(RUN_YAML)
    argv = ["train", "-f", "run.yaml", "--vars.dim", "32", "--vars.tag", "1e3", "--enable_progress_bar"]
    assert main([*argv, "--model.args.dim.__value_type", "int", "--model.args.dim.value", "8", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["args"] == {"dim": {"__value_type": "int", "value": "8"}, "nlayers": 2}
    assert printed["dataset"]["train_args"] == {"dim": 32, "size": 100}
    assert printed["instance_name"] == "run-1e3-32" and printed["enable_progress_bar"] is True
    assert "vars" not in printed
