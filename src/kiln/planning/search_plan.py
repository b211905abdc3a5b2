"""The records of ``kiln plan --search``: :class:`SearchPlan`, one plan (its sizes, and once priced
its memory, collectives and seconds; the dotted overrides that run it), and :class:`SearchResult`,
the feasible plans with what the search was asked and why the others fell, both as ``--json``
writes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.cost.devices import COMPUTE_EFFICIENCY, DeviceClass
from kiln.planning.search_shape import ModelShape

__all__ = ["SearchPlan", "SearchResult"]


@dataclass
class SearchPlan:
    """One plan and its price (bytes per rank of its largest stage, seconds per optimizer step)."""

    dp_shard: int
    tp: int
    pp: int
    activation_checkpointing: str | None
    micro_batch_size: int  # sequences per forward (a pipeline microbatch)
    microbatches: int  # per step and rank: accumulation steps, or the pipeline's microbatches
    schedule: str = "1f1b"  # a pipeline's: "1f1b" (a stage a rank) or "interleaved1f1b" (2 a rank)
    memory: dict[str, int] = field(default_factory=dict)
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens_per_second: float = 0.0  # per device
    split_points: list[str] = field(default_factory=list)
    reason: str = ""  # why it is infeasible ("" when it is not)
    activation_moments: dict[str, int] = field(default_factory=dict)  # kiln.planning.search_memory's
    measured: dict[str, int] | None = None  # memory its dry run measured (kiln.planning.confirm), if run
    estimated: dict[str, int] | None = None  # the closed form's memory, once measured replaced it

    @property
    def stages_per_rank(self) -> int:
        return 2 if self.schedule == "interleaved1f1b" else 1

    @property
    def label(self) -> str:
        ac = "ckpt" if self.activation_checkpointing else "-"
        interleaved = " interleaved" if self.stages_per_rank > 1 else ""
        return f"{self.dp_shard}x{self.tp}x{self.pp}{interleaved} {ac} mb{self.micro_batch_size}x{self.microbatches}"

    def overrides(self) -> list[str]:
        """The dotted overrides of a run file for this plan (for ``kiln plan --dry-run`` or ``kiln train``)."""
        out = ["--compute_config.dp_shard", str(self.dp_shard), "--compute_config.tp", str(self.tp)]
        out += ["--compute_config.pp", str(self.pp)]
        if self.pp > 1:
            options: dict[str, Any] = {"split_points": self.split_points, "microbatches": self.microbatches}
            if self.schedule != "1f1b":
                options["schedule"] = self.schedule
            out += ["--compute_config.strategy_options", repr(options)]
            out += ["--micro_batch_size", str(self.micro_batch_size * self.microbatches)]
            out += ["--grad_accumulation_steps", "1"]
        else:
            out += ["--micro_batch_size", str(self.micro_batch_size)]
            out += ["--grad_accumulation_steps", str(self.microbatches)]
        out += ["--activation_checkpointing", self.activation_checkpointing or "null"]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp_shard": self.dp_shard,
            "tp": self.tp,
            "pp": self.pp,
            "activation_checkpointing": self.activation_checkpointing,
            "micro_batch_size": self.micro_batch_size,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
            "memory": dict(self.memory),
            "collectives": {k: dict(v) for k, v in self.collectives.items()},
            "seconds": dict(self.seconds),
            "tokens_per_second_per_device": self.tokens_per_second,
            "overrides": self.overrides(),
            "confirmed": self.measured is not None,
            **({"estimated_memory": dict(self.estimated)} if self.estimated is not None else {}),
        }


@dataclass
class SearchResult:
    """The feasible plans, cheapest first, and how many of the others fell for each reason."""

    plans: list[SearchPlan]
    infeasible: dict[str, int]
    searched: int
    device: DeviceClass
    world_size: int
    budget: int | None
    global_batch: int
    seq_len: int
    precision: str
    shape: ModelShape
    devices_per_node: int = 8

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        d = self.device
        return {
            "world_size": self.world_size,
            "device": d.name,
            "constants": {
                "bf16_flops": d.bf16_flops,
                "compute_efficiency": COMPUTE_EFFICIENCY,
                "memory": d.memory,
                "intra_node_bw": d.intra_node_bw,
                "inter_node_bw": d.inter_node_bw,
                "devices_per_node": d.devices_per_node,
            },
            "budget": self.budget,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "precision": self.precision,
            "model": {
                "num_parameters": self.shape.num_parameters,
                "num_layers": self.shape.num_layers,
                "hidden": self.shape.hidden,
                "heads": self.shape.heads,
                "kv_heads": self.shape.kv_heads,
                "vocab": self.shape.vocab,
            },
            "searched": self.searched,
            "feasible": len(self.plans),
            "infeasible": dict(self.infeasible),
            "plans": [p.to_dict() for p in self.plans[:top]],
        }
