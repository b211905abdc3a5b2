"""Optimizer-side libraries: Composer-style time-aware schedulers, Colossal-AI step-counted ones,
and the fused/foreach step kiln picks by default (:mod:`kiln.optim.implementation`)."""

from kiln.optim import colossal as _colossal
from kiln.optim import schedulers as _schedulers
from kiln.optim.colossal import *  # noqa: F403
from kiln.optim.implementation import apply_default_implementation, choose_implementation
from kiln.optim.schedulers import *  # noqa: F403  (also re-exports kiln.optim.lr_scheduler's names)

__all__ = [*_schedulers.__all__, *_colossal.__all__, "apply_default_implementation", "choose_implementation"]
