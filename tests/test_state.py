"""`kiln.State` is declared: every field typed and documented in kiln/core/state.py, an undeclared
attribute refused, and no module outside kiln/core writing a private or undeclared one."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import kiln

SRC = Path(kiln.__file__).parent
FIELDS = {f.name for f in dataclasses.fields(kiln.State)}


def test_every_field_is_typed_and_has_a_one_line_docstring():
    tree = ast.parse((SRC / "core" / "state.py").read_text())
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "State").body
    documented = set()
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign):
            name = node.target.id
            assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant), (
                f"State.{name} has no docstring"
            )
            assert "\n" not in after.value.value, f"State.{name}'s docstring is longer than a line"
            documented.add(name)
    assert documented == FIELDS


def test_an_undeclared_attribute_is_refused():
    state = kiln.State(torch.nn.Linear(1, 1))
    with pytest.raises(AttributeError):
        state.not_a_field = 1
    assert state.loss_fn is None and state.config is None and state.stop_reason is None  # declared, not set yet


def _is_state(node: ast.expr) -> bool:
    """``state``, ``self.state``, ``trainer.state``: the names kiln gives a State."""
    return (isinstance(node, ast.Name) and node.id == "state") or (
        isinstance(node, ast.Attribute) and node.attr == "state"
    )


def _written(node: ast.AST):
    """(attribute, line) for each attribute of a State that ``node`` assigns, deletes or setattr()s."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("setattr", "delattr")
        and node.args
        and _is_state(node.args[0])
    ):
        name = node.args[1]
        yield (name.value if isinstance(name, ast.Constant) else f"<{ast.unparse(name)}>"), node.lineno
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute) and _is_state(target.value):
            yield target.attr, target.lineno


def test_no_module_outside_core_writes_a_private_or_undeclared_state_attribute():
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name, line in _written(node):
                if name.startswith("_") or name not in FIELDS:
                    bad.append(f"{path.relative_to(SRC)}:{line} writes state.{name}")
    assert not bad, "declare the field in kiln/core/state.py (private ones are kiln.core's):\n" + "\n".join(bad)


def test_the_scan_sees_private_and_undeclared_writes():
    code = "state._stop = True\nself.state.x, y = 1, 2\nsetattr(state, '_p', 1)\nstate.loss = 1\nother.z = 1\n"
    found = [name for node in ast.walk(ast.parse(code)) for name, _ in _written(node)]
    assert sorted(found) == ["_p", "_stop", "loss", "x"]
