"""Colossal-AI's step-counted learning-rate schedulers (``colossalai.nn.lr_scheduler``) on torch.

Each takes ``(optimizer, total_steps, ...)`` with Colossal-AI's argument names and defaults, is a
real `torch.optim.lr_scheduler.LRScheduler` (subclassing torch's scheduler of the same family where
one exists), and is stepped once per optimizer step. ``step`` below is ``last_epoch``: 0 right after
construction, ``k`` after ``k`` calls to ``scheduler.step()``.

Import them from here (or from `kiln.optim`). The plain schedules and their shared closed-form base
live in `kiln.optim.colossal_plain`; the warmup and flat-start forms (``CosineAnnealingWarmupLR``,
``FlatAnnealingLR``, ``FlatAnnealingWarmupLR``, ``LinearWarmupLR``, ``MultiStepWarmupLR``,
``PolynomialWarmupLR``) in `kiln.optim.colossal_warmup`, which builds on the plain ones. Imports
run one way, colossal -> colossal_warmup -> colossal_plain, with no cycle.

Conventions, shared by every scheduler in both modules:

* Learning rates follow the closed form in each docstring, from ``step`` and ``base_lrs`` alone.
  torch's own ``get_lr`` is mostly recursive (it rescales the optimizer's *current* lr), which
  drifts by rounding over long runs and continues correctly after a resume only if the optimizer's
  ``param_groups`` were restored first. With a closed form, ``last_epoch`` and ``base_lrs`` - both
  in ``state_dict()`` - are the whole state, so a resumed scheduler repeats the uninterrupted
  learning rates bit for bit.
* Warmup is Colossal-AI's: ``lr = base_lr * (step + 1) / warmup_steps`` for
  ``step < warmup_steps``, so step 0 already trains at ``base_lr / warmup_steps`` and step
  ``warmup_steps - 1`` reaches ``base_lr``. ``LinearWarmupLR`` alone divides by
  ``warmup_steps + 1``, as Colossal-AI's does.
* The schedule that follows warmup restarts its own clock: it sees ``t = step - warmup_steps``
  over ``T = total_steps - warmup_steps`` steps.
* Past ``total_steps`` the lr holds its final value (torch's cosine would climb back up and
  Colossal-AI's linear decay would go negative if a loop steps once too often).

Examples:
    >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    >>> sched = CosineAnnealingWarmupLR(opt, total_steps=6, warmup_steps=2)
    >>> lrs = []
    >>> for _ in range(3):
    ...     lrs.append(opt.param_groups[0]["lr"])
    ...     opt.step()
    ...     sched.step()
    >>> lrs  # warmup: base_lr * (step + 1) / warmup_steps, then the cosine from base_lr
    [0.5, 1.0, 1.0]
"""

from kiln.optim.colossal_plain import CosineAnnealingLR, ExponentialLR, MultiStepLR, OneCycleLR, PolynomialLR
from kiln.optim.colossal_warmup import (
    CosineAnnealingWarmupLR,
    FlatAnnealingLR,
    FlatAnnealingWarmupLR,
    LinearWarmupLR,
    MultiStepWarmupLR,
    PolynomialWarmupLR,
)

__all__ = [
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
