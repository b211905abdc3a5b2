"""``compute_config``: kiln's strategy and mesh sizes, and nnScaler's compute config mapped onto them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.config.components import check_count
from kiln.config.overrides import ConfigError, close_match, format_error
from kiln.config.types import check_fields

__all__ = ["PAS_POLICIES", "ComputeConfig"]

# nnScaler's built-in policies (nnscaler.policies.pas_<name>) and the kiln strategy each becomes.
PAS_POLICIES = {"autodist": "auto", "dp": "ddp", "data": "ddp", "tp": "hybrid", "hybrid": "hybrid"}
# Built-in policies kiln cannot mean without more from the user: what to write instead.
_PAS_INSTEAD = {
    "pp": "nnScaler splits the model into stages itself; kiln needs the stage boundaries: set compute_config.strategy "
    "'hybrid' with compute_config.pp N and compute_config.strategy_options.split_points [module names]",
}


@dataclass(kw_only=True)
class ComputeConfig:
    """Where and how the model runs: kiln's strategy and mesh, and nnScaler's compute config.

    Args:
        strategy: a kiln.parallel strategy name (null: from pas_policy; 'autodist' is 'auto').
        strategy_options: keyword options of the strategy.
        dp_replicate: data-parallel replicas of a hybrid mesh.
        dp_shard: data-parallel shards of a hybrid mesh: -1 is the rest of the world; null (the
            default) leaves the choice to the strategy. Setting it, -1 included, selects the hybrid
            strategy as tp, pp or dp_replicate above 1 do: ``dp_shard: -1`` alone shards parameters,
            gradients and optimizer state over every rank (FSDP, zero3).
        tp: tensor-parallel degree (a value above 1 selects the hybrid strategy).
        pp: pipeline-parallel degree (a value above 1 selects the hybrid strategy).
        ep: expert-parallel degree: the experts of the model's kiln.models.MoE layers split over
            this many ranks, taken from dp_shard (a value above 1 selects the hybrid strategy).
        cp: context-parallel degree: each sequence split over this many ranks, which read the same
            batch (ring attention, CUDA only; a value above 1 selects the hybrid strategy).
        sequence_parallel: with tp above 1, shard the residual stream and norms on the sequence (null: on for the models kiln has a plan for; false: off); the tp/hybrid strategy's option.
        loss_parallel: with sequence parallelism, keep the logits sharded over the vocabulary and compute the loss on the shards (null: on with it; false: gathered logits).
        plan_ngpus: processes that hold one model replica (nnScaler); the rest is data parallel.
        runtime_ngpus: the world size this config is for; must equal the real world size when set.
        use_zero: shard optimizer state across data-parallel ranks (ZeRO-1: 'ddp' becomes 'zero1').
        zero_ngroups: nnScaler's ZeRO groups; only 1 is supported.
        use_end2end: the model's forward(batch) returns the loss (null: inferred from model and criterion).
        constant_folding: nnScaler code generation; accepted, no effect in kiln.
        trace_strategy: nnScaler code generation; accepted, no effect in kiln.
        use_async_reducer: nnScaler reducer option; accepted, no effect in kiln.
        reducer_bucket_cap_mb: nnScaler reducer option; accepted, no effect in kiln.
        zero_use_reduce_scatter: nnScaler ZeRO option; accepted, no effect in kiln.
        inference_only: nnScaler option; must be false for training.
        pas_config: options of nnScaler's parallel policy; accepted, no effect in kiln.
        user_config: free-form user values (kept in the printed config).
        timeout: seconds every collective waits for all ranks (the process-group timeout); a rank
            that does not arrive in time ends the job with one line naming it.
    """

    strategy: str | None = None
    strategy_options: dict[str, Any] = field(default_factory=dict)
    dp_replicate: int = 1
    dp_shard: int | None = None
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    sequence_parallel: bool | None = None
    loss_parallel: bool | None = None
    plan_ngpus: int | None = None
    runtime_ngpus: int | None = None
    use_zero: bool = False
    zero_ngroups: int = 1
    use_end2end: bool | None = None
    constant_folding: bool = False
    trace_strategy: str | None = None
    use_async_reducer: bool = False
    reducer_bucket_cap_mb: float | None = None
    zero_use_reduce_scatter: bool = False
    inference_only: bool = False
    pas_config: dict[str, Any] = field(default_factory=dict)
    user_config: dict[str, Any] = field(default_factory=dict)
    timeout: float = 600.0

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.timeout < float("inf"):  # NaN fails too
            raise ConfigError(
                format_error("timeout", self.timeout, "a positive number of seconds, e.g. 600"), path="timeout"
            )
        for name in ("dp_replicate", "tp", "pp", "ep", "cp", "plan_ngpus", "runtime_ngpus"):
            check_count(self, name)
        check_count(self, "dp_shard", also=(-1,))
        for name in ("sequence_parallel", "loss_parallel"):  # options of the tp and hybrid strategies
            value = getattr(self, name)
            if value is None:
                continue
            if self.strategy_options.get(name, value) != value:
                raise ConfigError(
                    format_error(
                        f"compute_config.{name}",
                        value,
                        f"the same as compute_config.strategy_options.{name} ({self.strategy_options[name]!r}), "
                        "or only one of them",
                    ),
                    path=f"compute_config.{name}",
                )
            self.strategy_options = {**self.strategy_options, name: value}
        if self.zero_ngroups != 1:
            raise ConfigError(
                format_error("zero_ngroups", self.zero_ngroups, "1 (kiln shards over the whole data-parallel group)"),
                path="zero_ngroups",
            )
        if self.inference_only:
            raise ConfigError(format_error("inference_only", True, "false: kiln train trains"), path="inference_only")

    def _policy_strategy(self, pas_policy: str) -> str:
        """The kiln strategy for nnScaler's built-in ``pas_policy`` (compute_config.strategy unset)."""
        known = ", ".join(PAS_POLICIES)
        if pas_policy in _PAS_INSTEAD:
            raise ConfigError(
                format_error("pas_policy", pas_policy, f"one of {known}: {_PAS_INSTEAD[pas_policy]}"), path="pas_policy"
            )
        if pas_policy not in PAS_POLICIES:
            match = close_match(pas_policy, [*PAS_POLICIES, *_PAS_INSTEAD])
            hint = f" (did you mean {match!r}?)" if match and "." not in pas_policy else ""
            raise ConfigError(
                format_error(
                    "pas_policy",
                    pas_policy,
                    f"one of nnScaler's built-in policies {known}; "
                    "kiln does not run policy functions: set compute_config.strategy to a "
                    "kiln.parallel strategy instead",
                )
                + hint,
                path="pas_policy",
            )
        plan = self.plan_ngpus or 1
        if pas_policy == "dp" and plan > 1:  # nnScaler's pas_dp refuses the same
            raise ConfigError(
                format_error(
                    "compute_config.plan_ngpus",
                    plan,
                    "1 with pas_policy 'dp' (pure data "
                    "parallelism); use pas_policy 'tp' to split the model over plan_ngpus",
                ),
                path="compute_config.plan_ngpus",
            )
        if pas_policy == "tp" and plan == 1:
            return "ddp"  # one process per replica: nothing to split, as nnScaler's pas_tp does
        if pas_policy == "hybrid" and plan > 1:
            raise ConfigError(
                format_error(
                    "pas_policy",
                    pas_policy,
                    f"a policy kiln can lay out: nnScaler's hybrid "
                    f"policy picks its own pipeline stages over plan_ngpus={plan}; set "
                    "compute_config.tp and compute_config.pp (with strategy_options."
                    "split_points when pp > 1), or pas_policy 'tp'",
                ),
                path="pas_policy",
            )
        return PAS_POLICIES[pas_policy]

    def mesh_degrees(self, pas_policy: str) -> tuple[int, int]:
        """``(tp, pp)`` of the hybrid mesh: the fields, or ``pas_policy: tp``'s split over ``plan_ngpus``."""
        plan = self.plan_ngpus or 1
        if self.strategy is None and pas_policy == "tp" and self.tp == self.pp == 1 and plan > 1:
            return plan, 1
        return self.tp, self.pp

    @property
    def mesh_size(self) -> int:
        """Processes that read one batch: ``plan_ngpus`` if set, else ``tp * pp * cp``."""
        return self.plan_ngpus or self.tp * self.pp * self.cp

    def check_pipeline(self, world_size: int, pas_policy: str) -> None:
        """Refuse a pipeline schedule (``strategy_options.schedule``) that is not known, or whose stages
        (``split_points``) or ``microbatches`` it cannot run on the pipeline ranks of a world of
        ``world_size``, in one line, before any process group exists."""
        from kiln.parallel.pipelining.schedules import SCHEDULES, stage_count_error

        options = self.strategy_options
        name = self.strategy_name(pas_policy, world_size)
        if name not in ("pp", "hybrid") or "schedule" not in options and "split_points" not in options:
            return
        path = "compute_config.strategy_options.schedule"
        schedule = str(options.get("schedule", "1f1b")).lower()
        if schedule not in SCHEDULES:
            match = close_match(schedule, SCHEDULES)
            hint = f" (did you mean {match!r}?)" if match else ""
            raise ConfigError(
                format_error(path, options["schedule"], f"one of {', '.join(SCHEDULES)}") + hint, path=path
            )
        pp = world_size if name == "pp" else self.mesh_degrees(pas_policy)[1]
        splits = options.get("split_points")
        splits = [splits] if isinstance(splits, str) else splits
        microbatches = options.get("microbatches")
        if pp > 1 and isinstance(splits, (list, tuple)) and (microbatches is None or isinstance(microbatches, int)):
            error = stage_count_error(len(splits) + 1, pp, schedule, microbatches)
            if error:
                raise ConfigError(f"compute_config.strategy_options: {error}", path="compute_config.strategy_options")

    def check_expert_parallel(self, world_size: int) -> None:
        """Refuse an ``ep`` that does not divide ``dp_shard`` in a world of ``world_size`` (expert
        parallelism takes its ranks from ``dp_shard``), before any process group exists."""
        if self.ep == 1:
            return
        shard = self.dp_shard
        if shard is None or shard == -1:
            shard = world_size // (self.mesh_size * self.dp_replicate)
        if shard % self.ep:
            raise ConfigError(
                format_error(
                    "compute_config.ep",
                    self.ep,
                    f"a divisor of dp_shard = {shard} in a world of {world_size} (expert parallelism takes its "
                    "ranks from dp_shard)",
                ),
                path="compute_config.ep",
            )

    def check_context_parallel(self, device_type: str) -> None:
        """Refuse ``cp > 1`` on a ``device_type`` where torch's ring attention cannot run, before
        any process starts (the strategy refuses it again at setup, for runs built in code)."""
        from kiln.parallel.context import check_context_parallel

        try:
            check_context_parallel(self.cp, device_type)
        except ValueError as e:
            raise ConfigError(f"compute_config.cp: {e}", path="compute_config.cp") from None

    def strategy_name(self, pas_policy: str, world_size: int) -> str:
        """The kiln strategy this config asks for (before ``"auto"`` is resolved by the world)."""
        value: object  # the field value that chose the strategy, for the error message
        if self.strategy is not None:
            name, path, value = self.strategy, "compute_config.strategy", self.strategy
        elif (
            self.tp > 1
            or self.pp > 1
            or self.ep > 1
            or self.cp > 1
            or self.dp_replicate > 1
            or self.dp_shard is not None
        ):
            name, path, value = "hybrid", "compute_config.tp", self.tp
        else:
            name, path, value = self._policy_strategy(pas_policy), "pas_policy", pas_policy
        if self.use_zero and (name == "ddp" or (name == "auto" and world_size > 1)):
            name, path, value = "zero1", "compute_config.use_zero", True
        from kiln.parallel import strategy_names

        known = strategy_names()
        if name not in known:
            match = close_match(name, known)
            hint = f" (did you mean {match!r}?)" if match else ""
            raise ConfigError(
                format_error(
                    path, value, f"a config for a known strategy; strategy {name!r} is not one of {', '.join(known)}"
                )
                + hint,
                path=path,
            )
        return name
