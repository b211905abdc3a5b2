"""Old import paths of modules that moved, kept working.

The fourth release split ``kiln.parallel`` by concept (the strategies; ``transforms/``,
``pipelining/`` and ``state/`` beneath them) and moved planning out of it: what ``strategy="auto"``
estimates with to :mod:`kiln.cost`, the search and the dry run to :mod:`kiln.planning`, above the
Trainer. Code and documentation written against the old paths (``from kiln.parallel.dry_run import
dry_run``) still imports: each old name resolves to the very module at its new home (one module
object under two names, so a patch through either reaches both). The redirection is a finder on
``sys.meta_path`` that :mod:`kiln` installs, not an import in the old package: a layer never
imports the layers above it, even to keep an old name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["MOVED", "install"]

# old module path -> new module path
MOVED: dict[str, str] = {
    "kiln.parallel.parallelize": "kiln.parallel.transforms.parallelize",
    "kiln.parallel.levers": "kiln.parallel.transforms.levers",
    "kiln.parallel.float8": "kiln.parallel.transforms.float8",
    "kiln.parallel.expert": "kiln.parallel.transforms.expert_parallel",
    "kiln.parallel.pipeline_schedules": "kiln.parallel.pipelining.schedules",
    "kiln.parallel.pipeline_boundary": "kiln.parallel.pipelining.boundary",
    "kiln.parallel.tp_trace": "kiln.parallel.pipelining.tp_trace",
    "kiln.parallel.traced_casts": "kiln.parallel.pipelining.traced_casts",
    "kiln.parallel.dcp_state": "kiln.parallel.state.dcp_state",
    "kiln.parallel.state_dict": "kiln.parallel.state.state_dict",
    "kiln.parallel.grad_norm": "kiln.parallel.state.grad_norm",
    "kiln.parallel.mesh": "kiln.parallel.state.mesh",
    "kiln.parallel.optimizer_params": "kiln.parallel.state.optimizer_params",
    "kiln.parallel.auto": "kiln.cost.auto",
    "kiln.parallel.plan": "kiln.cost.memory",
    "kiln.parallel.activation_memory": "kiln.cost.activations",
    "kiln.parallel.devices": "kiln.cost.devices",
    "kiln.parallel.search": "kiln.planning.search",
    "kiln.parallel.dry_run": "kiln.planning.dry_run",
    "kiln.parallel.comm_count": "kiln.planning.comm_count",
    "kiln.parallel.fake_world": "kiln.planning.fake_world",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        # the module at its new home: the import system then files it under the old name too
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed at its new home


_FINDER = _Alias()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
