"""The config-dict layer: YAML loading, dotted CLI overrides, references, __type building."""

from __future__ import annotations

import collections
import datetime
import pathlib

import pytest

from kiln.config.build import build_value, import_type
from kiln.config.overrides import (
    ConfigError,
    apply_overrides,
    close_match,
    delete_path,
    format_error,
    get_path,
    guess_value,
    load_yaml,
    merge,
    parse_overrides,
    resolve_references,
    set_path,
)


def _one_line(error: pytest.ExceptionInfo[ConfigError]) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- parse_overrides


def test_parse_space_and_equals_forms():
    assert parse_overrides(["--a.b.c", "1", "--x=abc", "--y=a=b"]) == [
        ("a.b.c", 1, False),
        ("x", "abc", False),
        ("y", "a=b", False),
    ]


def test_parse_dash_and_underscore_are_the_same():
    assert parse_overrides(["--max-epochs", "3", "--model.num-layers=2"]) == [
        ("max_epochs", 3, False),
        ("model.num_layers", 2, False),
    ]


def test_parse_deletion():
    assert parse_overrides(["--lr-scheduler!", "--a.b", "2"]) == [("lr_scheduler", None, True), ("a.b", 2, False)]


def test_parse_negative_number_is_a_value():
    assert parse_overrides(["--x", "-1"]) == [("x", -1, False)]


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("1", 1),
        ("-3", -3),
        ("1.5", 1.5),
        ("1e-3", 1e-3),
        ("[1,2]", [1, 2]),
        ("{'a': 1}", {"a": 1}),
        ("(1, 2)", (1, 2)),
        ("True", True),
        ("False", False),
        ("true", True),
        ("false", False),
        ("None", None),
        ("'1'", "1"),
        ("abc", "abc"),
        ("1.2.3", "1.2.3"),
        ("path/to.yaml", "path/to.yaml"),
        ("torch.optim.Adam", "torch.optim.Adam"),
        ("[a, b]", "[a, b]"),
        ("", ""),
    ],
)
def test_literal_guessing(raw, expected):
    value = guess_value(raw)
    assert value == expected and type(value) is type(expected)
    assert parse_overrides(["--k", raw]) == [("k", expected, False)]
    assert parse_overrides([f"--k={raw}"]) == [("k", expected, False)]


def test_parse_without_guessing_keeps_strings():
    assert parse_overrides(["--name", "1e3", "--n=5"], guess=False) == [("name", "1e3", False), ("n", "5", False)]


def test_key_without_value_is_an_error():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--model.args.dim"])
    assert e.value.path == "model.args.dim"
    assert _one_line(e).startswith("model.args.dim: no value given for '--model.args.dim'")
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--max_epochs", "--seed", "1"])
    assert e.value.path == "max_epochs"


def test_bare_positional_is_an_error():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--a", "1", "stray"])
    assert "unexpected argument 'stray'" in _one_line(e)


def test_deletion_takes_no_value():
    with pytest.raises(ConfigError) as e:
        parse_overrides(["--a.b!=3"])
    assert e.value.path == "a.b"
    assert "takes no value" in str(e.value)
    with pytest.raises(ConfigError, match="unexpected argument '3'"):
        parse_overrides(["--a.b!", "3"])


@pytest.mark.parametrize("token", ["--", "--a..b", "--.a", "--a.", "--!"])
def test_bad_keys(token):
    with pytest.raises(ConfigError, match="bad option"):
        parse_overrides([token, "1"])


# ----------------------------------------------------------------------------- apply_overrides


BASE = {
    "max_epochs": 4,
    "lr_scheduler": None,
    "model": {"type": "pkg.MLP", "args": {"dim": 16}, "layers": [{"dim": 1}, {"dim": 2}]},
    "optimizer": {"type": "torch.optim.Adam", "args": {"lr": 0.01}},
    "log": [],
}


def test_nested_dotted_keys_and_new_dicts():
    out = apply_overrides(
        BASE, parse_overrides(["--model.args.dim", "32", "--model.args.nlayers=8", "--dataset.train_args.size", "100"])
    )
    assert out["model"]["args"] == {"dim": 32, "nlayers": 8}
    assert out["dataset"] == {"train_args": {"size": 100}}
    assert BASE["model"]["args"] == {"dim": 16} and "dataset" not in BASE  # input not mutated


def test_override_replaces_none_parent_and_whole_values():
    out = apply_overrides(
        BASE, parse_overrides(["--lr_scheduler.type", "pkg.Sched", "--optimizer.args", "{'lr': 1, 'eps': 2}"])
    )
    assert out["lr_scheduler"] == {"type": "pkg.Sched"}
    assert out["optimizer"]["args"] == {"lr": 1, "eps": 2}


def test_index_keys():
    out = apply_overrides(BASE, parse_overrides(["--model.layers.1.dim", "4", "--model.layers.0", "{'dim': 9}"]))
    assert out["model"]["layers"] == [{"dim": 9}, {"dim": 4}]
    out = apply_overrides(BASE, parse_overrides(["--log.0.type", "kiln.loggers.FileLogger"]))
    assert out["log"] == [{"type": "kiln.loggers.FileLogger"}]  # the list's length appends


def test_index_out_of_range_names_the_path():
    with pytest.raises(ConfigError) as e:
        apply_overrides(BASE, parse_overrides(["--model.layers.5.dim", "4"]))
    assert e.value.path == "model.layers.5"
    assert _one_line(e) == (
        "model.layers.5: index 5 is out of range, model.layers has 2 item(s) (indices 0-1, or 2 to append)"
    )


def test_non_index_into_list():
    with pytest.raises(ConfigError) as e:
        apply_overrides(BASE, parse_overrides(["--model.layers.first", "4"]))
    assert e.value.path == "model.layers.first"
    assert "expected a list index because model.layers is a list" in str(e.value)


def test_deletion():
    out = apply_overrides(BASE, parse_overrides(["--model.args!", "--model.layers.0!", "--max-epochs!"]))
    assert "args" not in out["model"] and "max_epochs" not in out
    assert out["model"]["layers"] == [{"dim": 2}]
    assert "args" in BASE["model"]


def test_deleting_a_missing_key_names_the_path():
    with pytest.raises(ConfigError) as e:
        apply_overrides(BASE, parse_overrides(["--optimizer.args.lrr!"]))
    assert e.value.path == "optimizer.args.lrr"
    message = _one_line(e)
    assert message.startswith("optimizer.args.lrr: unknown key 'lrr' in optimizer.args")
    assert "(did you mean 'lr'?)" in message and "cannot delete" in message


def test_overrides_apply_in_order():
    out = apply_overrides({"a": 1}, [("a", 2, False), ("a", None, True), ("a", 3, False)])
    assert out == {"a": 3}


# ----------------------------------------------------------------------------- path helpers


def test_get_set_path():
    cfg = {"a": {"b": [10, {"c": 3}]}, "n": {1: "int key"}}
    assert get_path(cfg, "a.b.1.c") == 3
    assert get_path(cfg, "n.1") == "int key"
    assert get_path(cfg, "a.x", default=None) is None
    with pytest.raises(ConfigError) as e:
        get_path(cfg, "a.bb")
    assert e.value.path == "a.bb" and "did you mean 'b'?" in str(e.value)
    with pytest.raises(ConfigError) as e:
        get_path(cfg, "a.b.0.c")
    assert e.value.path == "a.b.0.c"
    assert "a.b.0 is 10 (int), expected a mapping or a list" in str(e.value)
    set_path(cfg, "a.b.1.d", 4)
    set_path(cfg, "x.y", 5)
    assert cfg["a"]["b"][1] == {"c": 3, "d": 4} and cfg["x"] == {"y": 5}
    delete_path(cfg, "a.b.0")
    assert cfg["a"]["b"] == [{"c": 3, "d": 4}]


def test_close_match_and_format_error():
    assert close_match("max_epoch", ["max_epochs", "seed"]) == "max_epochs"
    assert close_match("zzz", ["max_epochs", "seed"]) is None
    assert format_error("max_epochs", "ten", "an int") == ("max_epochs: got 'ten' (str), expected an int")
    assert len(format_error("x", "y" * 500, "z")) < 120


def test_config_error_is_a_value_error_on_one_line():
    error = ConfigError("a.b: first\n  second", path="a.b")
    assert isinstance(error, ValueError)
    assert str(error) == "a.b: first second" and error.path == "a.b"


def test_merge():
    base = {"a": {"b": 1, "c": 2}, "d": [1]}
    assert merge(base, {"a": {"c": 3}, "d": [2], "e": 4}) == {"a": {"b": 1, "c": 3}, "d": [2], "e": 4}
    assert base == {"a": {"b": 1, "c": 2}, "d": [1]}


# ----------------------------------------------------------------------------- references


def test_exact_reference_keeps_its_type():
    cfg = {
        "dim": 16,
        "model": {"args": {"dim": "$(dim)", "dims": "${model.args.dim}"}},
        "opt": {"args": "$(model.args)"},
    }
    out = resolve_references(cfg, environ={})
    assert out["model"]["args"] == {"dim": 16, "dims": 16}
    assert out["opt"]["args"] == {"dim": 16, "dims": 16}
    assert out["opt"]["args"] is not out["model"]["args"]
    assert cfg["model"]["args"]["dim"] == "$(dim)"  # input not mutated


def test_interpolation_and_chains():
    cfg = {
        "name": "run",
        "dir": "/ckpt/$(name)/$(seed)",
        "seed": "$(base_seed)",
        "base_seed": 7,
        "layers": [{"dim": 4}],
        "first": "$(layers.0.dim)",
        "escaped": "$\\(name) is $(name)",
    }
    out = resolve_references(cfg, environ={})
    assert out["dir"] == "/ckpt/run/7" and out["seed"] == 7 and out["first"] == 4
    assert out["escaped"] == "$(name) is run"


def test_reference_through_a_referenced_dict_and_siblings():
    cfg = {"base": {"x": 1}, "alias": "$(base)", "y": "$(alias.x)", "a": {"x": 2, "y": "$(a.x)"}}
    out = resolve_references(cfg, environ={})
    assert out["y"] == 1 and out["a"]["y"] == 2


def test_environment_fallback():
    out = resolve_references({"dir": "$(KILN_TEST_HOME)/runs"}, environ={"KILN_TEST_HOME": "/h"})
    assert out["dir"] == "/h/runs"


def test_reference_cycle_names_the_cycle():
    with pytest.raises(ConfigError) as e:
        resolve_references({"a": "$(b)", "b": "x$(a)"}, environ={})
    assert e.value.path == "a"
    assert _one_line(e) == "a: circular reference a -> b -> a"


def test_self_reference_through_a_container_is_a_cycle():
    with pytest.raises(ConfigError) as e:
        resolve_references({"a": {"b": "$(a)"}}, environ={})
    assert _one_line(e) == "a: circular reference a -> a.b -> a"


def test_missing_reference_names_the_field_and_the_reference():
    cfg = {"optimizer": {"args": {"lr": 0.1}}, "sched": {"args": {"lr": "$(optimizer.args.lrr)"}}}
    with pytest.raises(ConfigError) as e:
        resolve_references(cfg, environ={})
    assert e.value.path == "sched.args.lr"
    assert _one_line(e) == (
        "sched.args.lr: reference '$(optimizer.args.lrr)' cannot be resolved: "
        "optimizer.args.lrr: unknown key 'lrr' in optimizer.args (did you mean 'lr'?)"
    )


def test_missing_reference_behind_another_reference_names_the_real_holder():
    with pytest.raises(ConfigError) as e:
        resolve_references({"a": "$(b.c)", "b": "$(nope)"}, environ={})
    assert e.value.path == "b"
    assert str(e.value).startswith("b: reference '$(nope)' cannot be resolved")


# ----------------------------------------------------------------------------- YAML files


def test_load_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_epochs: 4\nmodel:\n  type: pkg.MLP\n  args: {dim: 16}\n")
    assert load_yaml(path) == {"max_epochs": 4, "model": {"type": "pkg.MLP", "args": {"dim": 16}}}
    (tmp_path / "empty.yaml").write_text("")
    assert load_yaml(str(tmp_path / "empty.yaml")) == {}


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("a: 1\nb: 2\nmodel:\n  type: x\n  args: [1, 2\nc: 3\nd: {e: 1: 2}\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    message = _one_line(e)
    assert message.startswith(f"{path} line ") and e.value.path == str(path)
    path.write_text("a: 1\nb: 2\nc: 3\nd: 4\ne: 5\nf: 6\ng: h: 7\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert _one_line(e).startswith(f"{path} line 7: mapping values are not allowed here")


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert e.value.path == str(path)
    assert _one_line(e) == f"config file {str(path)!r} does not exist"


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path)
    assert _one_line(e).startswith(f"{path}: the top level is a list, expected a mapping")


def test_yaml_then_overrides_then_references(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("dim: 16\nmodel:\n  args:\n    dim: $(dim)\n")
    cfg = apply_overrides(load_yaml(path), parse_overrides(["--dim", "32"]))
    assert resolve_references(cfg, environ={})["model"]["args"]["dim"] == 32


# ----------------------------------------------------------------------------- __type building


def test_import_type():
    assert import_type("collections.OrderedDict") is collections.OrderedDict
    assert import_type("int") is int
    assert import_type("datetime.datetime.now") == datetime.datetime.now
    assert import_type(dict) is dict


def test_import_type_errors_name_path_and_type():
    with pytest.raises(ConfigError) as e:
        import_type("torch_nonexistent_pkg.Model", "model.type")
    assert e.value.path == "model.type"
    assert _one_line(e).startswith("model.type: cannot import 'torch_nonexistent_pkg.Model'")
    with pytest.raises(ConfigError) as e:
        import_type("collections.OrderedDct", "a.__type")
    assert _one_line(e) == (
        "a.__type: cannot import 'collections.OrderedDct': module 'collections' has no attribute "
        "or submodule 'OrderedDct' (did you mean 'collections.OrderedDict'?)"
    )
    with pytest.raises(ConfigError, match="got 3, expected a fully qualified name"):
        import_type(3, "x")


def test_build_type_with_arguments():
    cfg = {
        "model": {
            "args": {
                "timeout": {"__type": "datetime.timedelta", "minutes": 1, "seconds": 30},
                "table": {"__type": "collections.OrderedDict"},
                "items": [{"__type": "datetime.timedelta", "days": 1}, 3],
            }
        }
    }
    out = build_value(cfg)
    args = out["model"]["args"]
    assert args["timeout"] == datetime.timedelta(seconds=90)
    assert type(args["table"]) is collections.OrderedDict and args["table"] == {}
    assert args["items"] == [datetime.timedelta(days=1), 3]
    assert cfg["model"]["args"]["table"] == {"__type": "collections.OrderedDict"}


def test_build_nested_types():
    cfg = {"__type": "collections.OrderedDict", "inner": {"__type": "datetime.timedelta", "hours": 2}}
    out = build_value(cfg)
    assert out == collections.OrderedDict(inner=datetime.timedelta(hours=2))


def test_build_value_type():
    out = build_value(
        {
            "path": {"__value_type": "pathlib.Path", "value": "/tmp/x"},
            "name": {"__value_type": "str", "value": 1},
            "n": {"__value_type": "int", "value": "7"},
        }
    )
    assert out == {"path": pathlib.Path("/tmp/x"), "name": "1", "n": 7}


def test_build_rejected_argument_names_path_and_argument():
    with pytest.raises(ConfigError) as e:
        build_value({"a": {"b": {"__type": "datetime.timedelta", "minutes": 1, "mins": 2}}})
    assert e.value.path == "a.b"
    assert _one_line(e) == "a.b: datetime.timedelta does not accept argument(s) 'mins'"


def test_build_rejected_argument_with_signature_suggests_a_name():
    with pytest.raises(ConfigError) as e:
        build_value({"x": {"__type": "fractions.Fraction", "numerater": 1}}, "cfg")
    assert e.value.path == "cfg.x"
    assert _one_line(e) == (
        "cfg.x: fractions.Fraction does not accept argument(s) 'numerater' (did you mean 'numerater' -> 'numerator'?)"
    )


def test_build_unimportable_type():
    with pytest.raises(ConfigError) as e:
        build_value({"model": {"args": {"cfg": {"__type": "no_such_pkg_kiln.Config"}}}})
    assert e.value.path == "model.args.cfg.__type"
    assert "cannot import 'no_such_pkg_kiln.Config'" in _one_line(e)


def test_build_bad_value_type():
    with pytest.raises(ConfigError) as e:
        build_value({"n": {"__value_type": "int", "value": "abc"}})
    assert e.value.path == "n"
    assert _one_line(e).startswith("n: int rejected its arguments ('abc'):")
    with pytest.raises(ConfigError) as e:
        build_value({"n": {"__value_type": "int", "value": "1", "extra": 2}})
    assert e.value.path == "n" and "extra key(s) ['extra']" in str(e.value)


def test_null_on_the_command_line_is_none():
    from kiln.config.overrides import guess_value

    assert guess_value("null") is None and guess_value("None") is None and guess_value("nullable") == "nullable"
