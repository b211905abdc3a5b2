"""``kiln plan --search --confirm``: the search's first plans dry-run before they are ranked.

The search prices every plan in closed form (:mod:`kiln.planning.search_memory`), which agrees with
the dry run within 10% for the models and plans ``tests/test_search_vs_dry_run.py`` holds it to.
Where it may not (another architecture, a plan outside that grid), :func:`confirm` measures the
first plans instead: it dry-runs each (:mod:`kiln.planning.dry_run`, the run file with the plan's
overrides), replaces its estimated memory and collectives by the measured ones of its largest stage,
prices its step again with them, drops it if it no longer fits the budget (or if the dry run
refuses its configuration, as the real run would), and ranks again, until
the first ``top`` plans of the ranking are all measured ones (or ``max_runs`` dry runs were spent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.planning.search import SearchPlan, SearchResult, price_communication, rank

__all__ = ["Measured", "confirm", "dry_run_measure"]


@dataclass(frozen=True)
class Measured:
    """What a dry run of a plan measured on its largest rank (bytes; ``total`` its peak)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    total: int
    collectives: dict[str, dict[str, int]]


def confirm(
    result: SearchResult, measure: Callable[[SearchPlan], Measured], *, top: int = 3, max_runs: int | None = None
) -> SearchResult:
    """Dry-run the first plans of ``result`` until its first ``top`` are measured ones (module
    docstring); ``measure`` dry-runs one plan. Changes ``result`` in place and returns it.

    Args:
        result: a :func:`kiln.planning.search.search` result.
        measure: the dry run of a plan (:func:`dry_run_measure` for a run file).
        top: how many of the first plans must be measured.
        max_runs: at most this many dry runs (default ``3 x top``).
    """
    if top < 1:
        raise ValueError(f"--confirm={top} must be >= 1")
    runs = max_runs if max_runs is not None else 3 * top
    while runs > 0:
        todo = [p for p in result.plans[:top] if p.measured is None]
        if not todo:
            break
        plan = todo[0]
        runs -= 1
        try:
            got = measure(plan)
        except ValueError:  # a configuration the real run refuses too: not a plan
            result.plans.remove(plan)
            result.infeasible["refused by its dry run"] = result.infeasible.get("refused by its dry run", 0) + 1
            continue
        plan.estimated = dict(plan.memory)
        plan.measured = {
            "params": got.params,
            "grads": got.grads,
            "optimizer": got.optimizer,
            "activations": got.activations,
            "total": got.total,
        }
        plan.memory = dict(plan.measured)
        plan.collectives = {kind: dict(dims) for kind, dims in got.collectives.items()}
        price_communication(plan, result)
        if result.budget is not None and got.total > result.budget:
            result.plans.remove(plan)
            reason = "memory over the budget (measured by dry run)"
            result.infeasible[reason] = result.infeasible.get(reason, 0) + 1
        rank(result.plans)
    return result


def dry_run_measure(run_file: Any, extra: list[str], world_size: int) -> Callable[[SearchPlan], Measured]:
    """A ``measure`` for :func:`confirm`: the dry run of ``run_file`` (with the dotted overrides
    ``extra``, then the plan's) on ``world_size`` ranks, its largest stage's rank."""
    from kiln.config.args import load_trainer_args
    from kiln.planning.dry_run import dry_run

    def measure(plan: SearchPlan) -> Measured:
        args = load_trainer_args(run_file, [*extra, *plan.overrides()], world_size=world_size)
        report = dry_run(args, world_size)
        worst = max(report.ranks, key=lambda r: r.peak)
        # the collectives of the stage that moves the most (the stages of a pipeline differ)
        moved = max(report.ranks, key=lambda r: sum(sum(d.values()) for d in r.collectives.values()))
        return Measured(
            params=worst.params,
            grads=worst.grads,
            optimizer=worst.optimizer,
            activations=worst.activations,
            total=worst.peak,
            collectives={kind: dict(dims) for kind, dims in moved.collectives.items()},
        )

    return measure
