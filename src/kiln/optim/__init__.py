"""Optimizer-side libraries: Composer-style time-aware schedulers and Colossal-AI step-counted ones."""

from kiln.optim import colossal as _colossal
from kiln.optim import schedulers as _schedulers
from kiln.optim.colossal import *  # noqa: F403
from kiln.optim.schedulers import *  # noqa: F403  (also re-exports kiln.optim.lr_scheduler's names)

__all__ = [*_schedulers.__all__, *_colossal.__all__]
