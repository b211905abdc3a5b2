"""Warnings other packages log while torchao is imported: kept off a run that did not ask for torchao.

transformers (5.x) imports torchao whenever it is installed, from ``modeling_utils`` (its quantizer
table), so every Hugging Face run imports it, float8 or not. torchao's ``__init__`` then logs a
warning per optional kernel library it cannot load on this machine (``Failed to load
.../torchao/_C_mxfp8...so``: built for another Python or CUDA), and registering its enums with
torch's pytree makes torch log a deprecation meant for torchao's developers: four lines per rank
that nothing in the run can act on. kiln's own code imports torchao only for ``float8=``, which
needs none of those kernels (:mod:`kiln.parallel.transforms.float8`).

:func:`quiet_torchao_import` (called by ``import kiln``) adds a filter to the two loggers that drops
records of level WARNING and below while torchao's package or one of its modules is being
imported, and nothing else:
errors, and every record logged after the import (torchao's warnings at use included), pass.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["quiet_torchao_import"]

# the loggers torchao's import speaks through: its own, and torch's pytree (register_constant)
_LOGGERS = ("torchao", "torch.utils._pytree")


def _importing(package: str) -> bool:
    """Whether ``package`` or one of its modules is being imported right now (its code is running)."""
    for name, module in list(sys.modules.items()):
        if name == package or name.startswith(package + "."):
            # what CPython's own import lock checks (importlib._bootstrap._find_and_load)
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                return True
    return False


class _TorchaoImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING or not _importing("torchao")


_FILTER = _TorchaoImportNoise()


def quiet_torchao_import() -> None:
    """Drop the warnings logged during torchao's import (idempotent). See the module's docstring."""
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
