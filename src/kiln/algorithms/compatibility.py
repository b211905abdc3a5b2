"""Which algorithms may run together, and in what order (the rules in ``kiln.algorithms``' docstring)."""

from __future__ import annotations

from collections.abc import Sequence

from kiln.core.callback import Algorithm

__all__ = ["check_algorithm_compatibility"]


def _names(algorithms: Sequence[Algorithm]) -> str:
    return "[" + ", ".join(type(a).__name__ for a in algorithms) + "]"


def check_algorithm_compatibility(algorithms: Sequence[Algorithm]) -> None:
    """Raise ``ValueError`` if ``algorithms`` cannot run together in this order.

    The Trainer calls this when it is built. The rules:

    1. At most one algorithm interpolates the loss (``interpolates_loss``: MixUp or CutMix with
       ``interpolate_loss=True``): a second would interpolate an already interpolated loss with
       a partner drawn for a different mix.
    2. Each kiln algorithm at most once: two copies would apply the same change twice.
    3. Not EMA and SWA together: both decide which weights are evaluated.
    4. Not SAM with a loss-interpolating algorithm: SAM's second pass computes ``state.loss_fn``
       only and would take its gradient of a different loss.

    Example::

        check_algorithm_compatibility([MixUp(interpolate_loss=True), CutMix(interpolate_loss=True)])
        # ValueError: only one loss-interpolating algorithm may run ...
    """
    from kiln.algorithms.ema import EMA
    from kiln.algorithms.sam import SAM
    from kiln.algorithms.swa import SWA

    algorithms = list(algorithms)
    for algorithm in algorithms:
        if not isinstance(algorithm, Algorithm):
            raise TypeError(
                f"algorithms must be kiln.Algorithm instances, got {type(algorithm).__name__} {algorithm!r}"
            )
    order = _names(algorithms)

    interpolating = [a for a in algorithms if a.interpolates_loss]
    if len(interpolating) > 1:
        raise ValueError(
            f"only one loss-interpolating algorithm may run, got {_names(interpolating)} in {order}; "
            "set interpolate_loss=False on all but one (mixed soft targets compose freely)"
        )

    seen: dict[type, int] = {}
    for algorithm in algorithms:
        kind = type(algorithm)
        if kind.__module__.startswith("kiln.algorithms.") and kind in seen:
            raise ValueError(
                f"{kind.__name__} appears twice in {order}; keep one (each kiln algorithm runs at most once)"
            )
        seen.setdefault(kind, len(seen))

    def first(kind: type) -> int | None:
        return next((i for i, a in enumerate(algorithms) if isinstance(a, kind)), None)

    if first(EMA) is not None and first(SWA) is not None:
        raise ValueError(
            f"EMA and SWA cannot run together in {order}: both replace the weights the model is "
            "evaluated with; choose one"
        )
    sam = first(SAM)
    if sam is not None and interpolating:
        raise ValueError(
            f"SAM cannot run with {type(interpolating[0]).__name__}(interpolate_loss=True) in {order}: "
            "SAM's second pass computes state.loss_fn only; use interpolate_loss=False"
        )
