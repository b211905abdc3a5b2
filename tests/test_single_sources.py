"""One home per constant and rule (issue 13, STYLE.md 13): save types, precision names, dtype
names, the strategy registry and sample counting each have one definition that everything else
imports, and the Colossal-AI scheduler modules import one another without a cycle."""

from __future__ import annotations

import ast
import types
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

import kiln
import kiln.parallel
from kiln.checkpoint import formats
from kiln.config import trainer_builder
from kiln.config.args import TrainerArgs
from kiln.config.components import CheckpointConfig, SaveType
from kiln.config.overrides import ConfigError
from kiln.core.batch import num_samples
from kiln.parallel.strategy import _BUILTIN, _lookup

SRC = Path(kiln.__file__).parent


def _assigned_names(path: Path) -> set[str]:
    """Names bound by module-level assignments in ``path``."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize(
    "name, home",
    [
        ("SAVE_TYPES", "checkpoint/formats.py"),
        ("PRECISIONS", "precision.py"),
        ("DTYPES", "precision.py"),
        ("TENSOR_TYPES", "precision.py"),
    ],
)
def test_each_constant_is_defined_once(name, home):
    """No second definition under another (or the same, private) name: the copies this replaced."""
    spellings = (
        {name, f"_{name}", "PRECISION_NAMES", "TENSOR_PRECISIONS"} if name != "SAVE_TYPES" else {name, f"_{name}"}
    )
    defined = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if _assigned_names(p) & spellings)
    assert defined == [home]


# -- save types ---------------------------------------------------------------------------------
def test_config_save_types_are_the_checkpoint_layers():
    """The config's Literal (it must spell its values out, and config imports no torch) is the home's."""
    assert typing.get_args(SaveType) == formats.SAVE_TYPES
    assert typing.get_type_hints(CheckpointConfig)["save_type"] == SaveType


def test_trainer_checks_save_type_with_the_checkpoint_rule(monkeypatch):
    monkeypatch.setattr(formats, "SAVE_TYPES", (*formats.SAVE_TYPES, "zip"))
    trainer = kiln.Trainer(nn.Linear(2, 2), criterion=nn.MSELoss(), save_type="zip", progress_bar=False)
    assert trainer.options.checkpointing.save_type == "zip"
    monkeypatch.undo()
    with pytest.raises(ValueError, match="save_type='zip' is not known; expected one of sharded, deduped, merged"):
        kiln.Trainer(nn.Linear(2, 2), criterion=nn.MSELoss(), save_type="zip", progress_bar=False)


# -- precision names and dtype names --------------------------------------------------------------
def _check_config_precision(spec):
    TrainerArgs._check_precision(types.SimpleNamespace(precision=spec))


def test_config_precision_names_are_kilns(monkeypatch):
    for name in ("none", *kiln.precision.PRECISIONS):
        _check_config_precision(name)
    with pytest.raises(ConfigError, match="precision: got 'fp8'"):
        _check_config_precision("fp8")
    monkeypatch.setattr(kiln.precision, "PRECISIONS", (*kiln.precision.PRECISIONS, "fp8"))
    _check_config_precision("fp8")  # read from kiln.precision, not a copy


def test_config_dtype_names_are_kilns():
    for name in ("none", *kiln.precision.DTYPES):
        _check_config_precision({"param": name, "buffer": name, "input": name})
    with pytest.raises(ConfigError, match="precision.param: got 'int8'"):
        _check_config_precision({"param": "int8"})
    with pytest.raises(ConfigError, match="precision.weights"):
        _check_config_precision({"weights": "bf16"})


def test_one_dtype_map():
    from kiln.checkpoint import offline

    assert offline.DTYPES is kiln.precision.DTYPES and trainer_builder.DTYPES is kiln.precision.DTYPES


@pytest.mark.parametrize(
    "spec, param, buffer, inputs",
    [
        ({"param": "bf16"}, torch.bfloat16, None, None),
        ({"param": "bfloat16", "input": "none"}, torch.bfloat16, None, None),
        ({"buffer": "fp32", "input": "fp16"}, None, torch.float32, torch.float16),
    ],
)
def test_config_per_tensor_precision(spec, param, buffer, inputs):
    precision = trainer_builder.build_precision(spec)
    assert (precision.param_dtype, precision.buffer_dtype, precision.input_dtype) == (param, buffer, inputs)
    assert precision.scaled is False


@pytest.mark.parametrize(
    "name, fields",
    [
        ("fp32", (None, None, None, None, False)),
        ("amp_bf16", (None, None, None, torch.bfloat16, False)),
        ("amp_fp16", (None, None, None, torch.float16, True)),
        ("bf16", (torch.bfloat16, torch.bfloat16, torch.bfloat16, None, False)),
        ("fp16", (torch.float16, torch.float16, torch.float16, None, True)),
        ("amp", (None, None, None, torch.float16, True)),
        ("float32", (None, None, None, None, False)),
    ],
)
def test_named_precisions(name, fields):
    p = kiln.precision.get_precision(name)
    assert (p.param_dtype, p.buffer_dtype, p.input_dtype, p.autocast_dtype, p.scaled) == fields
    assert p.name in kiln.precision.PRECISIONS


# -- the strategy registry ----------------------------------------------------------------------
def test_strategy_classes_come_from_the_registry():
    for name, path in _BUILTIN.items():
        cls = path.partition(":")[2]
        assert cls in kiln.parallel.__all__ and getattr(kiln.parallel, cls) is _lookup(name)
    # kiln.parallel lists no strategy module of its own: adding a strategy is one registry line
    init = ast.parse((SRC / "parallel" / "__init__.py").read_text())
    strings = {n.value for n in ast.walk(init) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & {path.partition(":")[2] for path in _BUILTIN.values()}


# -- counting samples ---------------------------------------------------------------------------
def test_one_num_samples():
    from kiln.algorithms import _batch

    assert _batch.num_samples is num_samples
    assert not (SRC / "trainer" / "batching.py").exists()  # batches have one home: kiln.core.batch


X, Y = torch.zeros(8, 3), torch.zeros(8)


@pytest.mark.parametrize(
    "batch, expected",
    [
        ((X, Y), 8),  # (inputs, targets)
        ([X, Y], 8),
        (X, 8),  # a bare tensor
        (torch.tensor(3.0), 1),  # a 0-dim tensor is one sample
        ({"input_ids": torch.zeros(4, 16), "labels": torch.zeros(4)}, 4),
        ({"id": ["a", "b"], "x": X}, 8),  # non-tensor leaves are passed over
        (("name", X), 8),
        ((torch.tensor(0.5), X), 8),  # so are 0-dim tensors, while a later tensor has rows
        ({"temperature": torch.tensor(0.5), "x": X}, 8),
        ((torch.tensor(1.0), torch.tensor(2.0)), 1),  # only 0-dim tensors: one sample
        ({"inputs": {"pixels": torch.zeros(5, 3)}, "y": torch.zeros(5)}, 5),  # nested, depth first
        (((X, Y), torch.zeros(2)), 8),
    ],
)
def test_num_samples(batch, expected):
    assert num_samples(batch) == expected
    assert type(num_samples(batch)) is int


@pytest.mark.parametrize("batch", [(), [], {}, "text", None, {"id": "a"}, (1, 2)])
def test_num_samples_without_a_tensor(batch):
    with pytest.raises(ValueError, match="cannot count the samples of a batch .* it holds no tensor"):
        num_samples(batch)


# -- the Colossal-AI scheduler modules ----------------------------------------------------------
def _optim_imports() -> dict[str, set[str]]:
    """kiln.optim module -> the kiln.optim modules it imports, at any depth of its code."""
    graph = {}
    for path in (SRC / "optim").glob("*.py"):
        module = "kiln.optim" if path.stem == "__init__" else f"kiln.optim.{path.stem}"
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kiln.optim"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)  # `from kiln.optim import x`
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("kiln.optim"))
        graph[module] = found
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycle_in_kiln_optim():
    graph = _optim_imports()
    assert graph["kiln.optim.colossal_plain"] == set()
    assert graph["kiln.optim.colossal_warmup"] == {"kiln.optim.colossal_plain"}
    done: set[str] = set()

    def visit(module, path):
        assert module not in path, f"import cycle: {' -> '.join([*path, module])}"
        if module not in done:
            for dep in graph[module] - {"kiln.optim"}:  # the package imports its members, not back
                visit(dep, [*path, module])
            done.add(module)

    for module in graph:
        visit(module, [])
    for name in ("colossal", "colossal_plain", "colossal_warmup"):
        tree = ast.parse((SRC / "optim" / f"{name}.py").read_text())
        assert not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body), name


COLOSSAL_NAMES = [
    "CosineAnnealingLR",
    "CosineAnnealingWarmupLR",
    "ExponentialLR",
    "FlatAnnealingLR",
    "FlatAnnealingWarmupLR",
    "LinearWarmupLR",
    "MultiStepLR",
    "MultiStepWarmupLR",
    "OneCycleLR",
    "PolynomialLR",
    "PolynomialWarmupLR",
]


def test_colossal_names_importable_as_before():
    import kiln.optim
    from kiln.optim import colossal

    assert sorted(colossal.__all__) == COLOSSAL_NAMES
    for name in COLOSSAL_NAMES:
        assert name in kiln.optim.__all__ and getattr(kiln.optim, name) is getattr(colossal, name)
