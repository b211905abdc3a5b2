"""``kiln plan --search`` in text: the sizes it reads (:func:`parse_bytes`, ``--memory``) and the
table it prints (:func:`format_plans`: the feasible plans cheapest first, the first plan's
collectives, and the command that dry-runs it)."""

from __future__ import annotations

import re

from kiln.planning.search_plan import SearchResult

__all__ = ["parse_bytes", "format_plans"]

_GiB = 1024**3
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1024, "mib": 1024**2, "gib": _GiB, "tib": 1024**4})


def parse_bytes(text: str | float | int) -> int:
    """``"80GiB"``, ``"141GB"``, ``"512MiB"`` or a number of bytes -> bytes."""
    match = re.fullmatch(r"([0-9.eE+]+)\s*([kKmMgGtT]i?[bB]|[bB])?", str(text).strip())
    value = None
    if match:
        try:
            value = float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()]
        except ValueError:
            value = None
    if value is None or value <= 0:
        raise ValueError(f"--memory {text!r} is not a size above 0; expected bytes or e.g. 80GiB, 141GB")
    return int(value)


def _gib(n: float) -> str:
    return f"{n / _GiB:.1f}"


def format_plans(result: SearchResult, top: int = 10, run_file: str | None = None) -> str:
    """The feasible plans as the text table ``kiln plan --search`` prints, cheapest first; the last
    line is the command that dry-runs the first plan, with ``run_file`` (the ``-f`` given)."""
    d = result.device
    budget = "none" if result.budget is None else f"{_gib(result.budget)} GiB"
    lines = [
        f"{result.shape.num_parameters:,} parameters on {result.world_size} x {d.name} ({d.devices_per_node} per node), "
        f"budget {budget} per rank, global batch {result.global_batch} x {result.seq_len} tokens, {result.precision}",
        f"searched {result.searched} plans: {len(result.plans)} feasible"
        + "".join(f"; {n} {reason}" for reason, n in result.infeasible.items()),
    ]
    head = (
        "  dp_shard x tp x pp",
        "ckpt",
        "mbs x n",
        "GiB/rank",
        "by",
        "compute s",
        "comm s",
        "bubble s",
        "step s",
        "tok/s/dev",
    )
    rows = []
    for i, p in enumerate(result.plans[:top]):
        rows.append(
            (
                ("* " if i == 0 else "  ")
                + f"{p.dp_shard} x {p.tp} x {p.pp}"
                + (" i" if p.stages_per_rank > 1 else ""),
                "full" if p.activation_checkpointing else "-",
                f"{p.micro_batch_size} x {p.microbatches}",
                _gib(p.memory["total"]),
                "dry run" if p.measured is not None else "estimate",
                f"{p.seconds['compute']:.3f}",
                f"{p.seconds['communication']:.3f}",
                f"{p.seconds['bubble']:.3f}",
                f"{p.seconds['total']:.3f}",
                f"{p.tokens_per_second:,.0f}",
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    if result.plans:
        best = result.plans[0]
        comm = "; ".join(
            f"{kind} {dim} {_gib(b)} GiB" for kind, dims in best.collectives.items() for dim, b in dims.items()
        )
        lines.append(f"first plan's collectives per step and rank: {comm or 'none'}")
        run = _quote(str(run_file)) if run_file is not None else "RUN.yaml"
        command = f"kiln plan -f {run} --dry-run --world-size {result.world_size} " + " ".join(
            _quote(a) for a in best.overrides()
        )
        lines.append(
            ("dry-run it: " if run_file is not None else "dry-run it with a run file of this model: ") + command
        )
    else:
        lines.append("no plan fits: add devices, raise --memory, or shorten the sequences / the global batch")
    return "\n".join(lines)


def _quote(arg: str) -> str:
    return f'"{arg}"' if any(c in arg for c in " '[{") else arg
