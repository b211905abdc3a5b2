"""DeepSpeed ZeRO through ``deepspeed.initialize``, for users who bring a ``deepspeed_config``.

kiln's own ``zero1``/``zero2``/``zero3`` need nothing beyond torch; this strategy exists so a
DeepSpeed JSON config (reference doc 002) keeps working. DeepSpeed is optional: without it the
strategy says so when it is created, before any process group or model is touched.

How the two engines share the loop: DeepSpeed's engine owns loss scaling, gradient reduction,
clipping and the optimizer step, so the strategy's ``make_scaler``, ``backward``,
``clip_gradients`` and ``optimizer_step`` hand them to it (the kiln Engine calls the same methods
under every strategy). kiln keeps the accumulation count (as for every strategy) and
tells DeepSpeed where the boundary is with ``set_gradient_accumulation_boundary``, exactly where it
would switch DDP's gradient sync; the loss arrives already divided by the count
(``scale_wrt_gas=False``). Settings kiln also has are filled into the config (Composer's rule: the
config may leave them out, and must not contradict them).

Checkpoints hold what every other strategy writes: full fp32 weights and the optimizer state keyed
by parameter name (DCP's flattened form), gathered with DeepSpeed's ``safe_get_full_*`` helpers. So
a DeepSpeed checkpoint loads under ddp or FSDP on any world size, and the other way round.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.parallel.strategy import Strategy
from kiln.parallel.transforms.parallelize import parallelize

if TYPE_CHECKING:
    from kiln.launch.context import Context
    from kiln.precision import Precision

__all__ = ["DeepSpeed"]

# kiln precision -> the deepspeed_config section it enables (amp_bf16 is kiln's autocast around an
# fp32 DeepSpeed engine, which needs no section)
_SECTIONS = {"fp32": None, "amp_bf16": None, "fp16": "fp16", "bf16": "bf16"}


def _require_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            "strategy='deepspeed' needs the 'deepspeed' package, which is not installed: "
            "run `pip install deepspeed`, or use strategy='zero1', 'zero2' or 'zero3', which need "
            "only torch"
        )


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _skip_inference_all_reduce_build() -> None:
    # DeepSpeed's communication backend builds its shared-memory all-reduce when it starts (a C++
    # extension compiled with ninja on first use: 100 s to 9 min of a 2-core machine, again whenever
    # its compile flags change), for deepspeed.comm's inference_all_reduce only, which training never
    # calls: kiln's collectives are torch.distributed's. Marked incompatible, it is not built (only
    # where DeepSpeed's CPU accelerator would build it: on CUDA the op does not exist).
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict) and "deepspeed_shm_comm" in compatible:
        compatible["deepspeed_shm_comm"] = False


class DeepSpeed(Strategy):
    """Model and optimizer wrapped by ``deepspeed.initialize(model, optimizer, config=...)``.

    kiln fills ``gradient_accumulation_steps`` from the Engine's ``gradient_accumulation``,
    ``gradient_clipping`` from ``clip_grad_norm`` (0, no clipping, when neither sets it: DeepSpeed's
    own default would clip at 1.0), the ``fp16``/``bf16`` section from ``precision``
    (``"fp16"``, ``"bf16"``; ``"amp_bf16"`` autocasts around an fp32 engine), and
    ``train_micro_batch_size_per_gpu`` (1) when no batch size is given: kiln feeds the batches, so
    DeepSpeed uses it only for its throughput log. A value in ``deepspeed_config`` that contradicts
    kiln's setting is an error naming both. ``precision="amp_fp16"`` is refused: DeepSpeed's fp16
    brings its own loss scaler (use ``"fp16"``).

    Args:
        deepspeed_config: a dict, or the path of a DeepSpeed JSON file.

    Example::

        engine, *_ = kiln.initialize(model, opt, config={"strategy": {"name": "deepspeed",
                                     "deepspeed_config": {"zero_optimization": {"stage": 2}}}})
    """

    name = "deepspeed"
    # deepspeed.initialize places, casts and wraps the model itself: kiln applies none of its steps.
    steps = ()

    def __init__(self, deepspeed_config: Mapping[str, Any] | str | Path | None = None, **config: Any) -> None:
        _require_deepspeed()
        if isinstance(deepspeed_config, (str, Path)):
            try:
                with open(deepspeed_config) as f:
                    deepspeed_config = json.load(f)
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"deepspeed_config={str(deepspeed_config)!r} could not be read as JSON ({exc}); "
                    "expected the path of a DeepSpeed JSON config or a dict"
                ) from None
        if deepspeed_config is not None and not isinstance(deepspeed_config, Mapping):
            raise ValueError(f"deepspeed_config={deepspeed_config!r} must be a dict or the path of a JSON file")
        self.config: dict[str, Any] = {**dict(deepspeed_config or {}), **config}
        self._groups: list[dict[str, Any]] = []  # the optimizer's param groups, by index
        self._group_of: dict[str, int] = {}  # parameter name -> group index

    # -- filling the config ------------------------------------------------------------------
    def _fill(self, key: str, value: Any, kiln_name: str) -> None:
        given = self.config.setdefault(key, value)
        if given != value:
            raise ValueError(
                f"deepspeed_config {key}={given!r} contradicts kiln's {kiln_name}={value!r}: kiln "
                f"fills {key!r} from {kiln_name}; drop it from deepspeed_config and set {kiln_name}="
                f"{given!r}"
            )

    def configure(self, *, gradient_accumulation: int, clip_grad_norm: float | None) -> None:
        # The Trainer splits batches itself (grad_accum) and marks the last microbatch through
        # set_grad_sync, so its Engine reports 1 here: name both in the error.
        self._fill(
            "gradient_accumulation_steps", gradient_accumulation, "gradient_accumulation (the Trainer's grad_accum)"
        )
        if clip_grad_norm is not None:
            self._fill("gradient_clipping", clip_grad_norm, "clip_grad_norm")
        else:  # kiln's default is no clipping; DeepSpeed's would be 1.0. An explicit value in the config stays.
            self.config.setdefault("gradient_clipping", 0.0)
        if "train_batch_size" not in self.config and "train_micro_batch_size_per_gpu" not in self.config:
            self.config["train_micro_batch_size_per_gpu"] = 1

    def _fill_precision(self, precision: Precision) -> None:
        if precision.name not in _SECTIONS:
            fixes = "'fp16' (DeepSpeed's fp16 with its loss scaler)" if precision.name == "amp_fp16" else "a name"
            raise ValueError(
                f"strategy='deepspeed' with precision={precision.name!r}: DeepSpeed casts and scales "
                f"itself; use precision={fixes} from {sorted(_SECTIONS)}"
            )
        wanted = _SECTIONS[precision.name]
        for section in ("fp16", "bf16"):
            if _enabled(self.config.get(section)) and section != wanted:
                raise ValueError(
                    f"deepspeed_config enables {section!r} but kiln's precision={precision.name!r}: "
                    f"set precision={section!r} in kiln (it fills deepspeed_config), or disable the "
                    "section"
                )
        if wanted is not None:
            self.config[wanted] = {**dict(self.config.get(wanted) or {}), "enabled": True}

    # -- placing the model -------------------------------------------------------------------
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, ctx: Context, precision: Precision
    ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        import deepspeed

        self._fill_precision(precision)
        # no step runs; this refuses compile= / activation_checkpointing= / float8= instead of ignoring them
        parallelize(self, model, self.parallelize_plan(model, ctx, precision))
        if optimizer is not None:
            # Remember which group each parameter is in: DeepSpeed replaces the groups' parameters
            # with flat partitions, but a checkpoint names them one by one.
            index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
            self._group_of = {n: index[id(p)] for n, p in model.named_parameters() if id(p) in index}
            self._groups = optimizer.param_groups
        import torch.distributed as dist

        # DeepSpeed reads LOCAL_RANK, which torchrun sets but SLURM, Open MPI and a lone process do not.
        os.environ.setdefault("LOCAL_RANK", str(ctx.local_rank))
        # deepspeed.initialize reuses the process group kiln's launcher created (any backend). A
        # world of 1 has none, and DeepSpeed cannot run without one: an in-process store makes it.
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if ctx.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
        _skip_inference_all_reduce_build()
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config, dist_init_required=False
        )
        engine.set_gradient_accumulation_boundary(True)  # until the Engine says a backward is not the last
        if not self._groups and ds_optimizer is not None:  # built by DeepSpeed from its "optimizer" section
            self._groups = ds_optimizer.param_groups
            self._group_of = {n: 0 for n, _ in model.named_parameters()}
        return engine, ds_optimizer

    # `model` below is DeepSpeed's engine: an nn.Module whose own methods (backward, step, module,
    # ...) the type checker cannot see, deepspeed having no type information; hence `engine: Any`.
    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        # kiln counts the micro-steps; DeepSpeed reduces gradients only on the boundary.
        engine: Any = model
        engine.set_gradient_accumulation_boundary(enabled)

    # DeepSpeed's engine scales the loss (its fp16 section), runs backward and steps, clipping
    # inside the step: kiln makes no scaler and hands over backward and the step.
    def make_scaler(self, precision: Precision, device: torch.device) -> torch.amp.GradScaler | None:
        return None

    def backward(
        self, model: nn.Module, loss: torch.Tensor, scale: float | None, scaler: torch.amp.GradScaler | None
    ) -> None:
        engine: Any = model
        engine.backward(loss if scale is None else loss * scale, scale_wrt_gas=False)

    def clip_gradients(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        max_norm: float,
        scaler: torch.amp.GradScaler | None,
    ) -> torch.Tensor | None:
        return None  # gradient_clipping in deepspeed_config: optimizer_step clips and returns the norm

    def optimizer_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> torch.Tensor | None:
        engine: Any = model
        if not self.config.get("gradient_clipping"):
            engine.step()
            return None
        if _partitioned(engine.module):  # ZeRO records the global norm it clipped by
            engine.step()
            norm = engine.get_global_grad_norm()
            return None if norm is None else torch.as_tensor(norm)
        # Without ZeRO the module's gradients are the averaged ones until step() clears them, and
        # DeepSpeed keeps no norm: read it first (no collective, every rank holds all of them).
        norm = torch.nn.utils.get_total_norm([p.grad for p in engine.module.parameters() if p.grad is not None])
        engine.step()
        return norm

    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise ValueError(
            "strategy='deepspeed' clips inside DeepSpeed's step: pass clip_grad_norm to kiln (it fills "
            "deepspeed_config's gradient_clipping) or set gradient_clipping there"
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "deepspeed_config": self.config}

    # -- checkpoints: full tensors keyed by parameter name -------------------------------------
    def state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, full: bool = False
    ) -> dict[str, Any]:
        module = self.unwrap(model)
        if not _partitioned(module):  # ZeRO off and fp32: the user's optimizer steps the module itself
            return super().state_dict(module, optimizer, full=full)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params = dict(module.named_parameters())
        state: dict[str, Any] = {
            "model": {
                name: safe_get_full_fp32_param(params[name]) if name in params else value.detach()
                for name, value in _named_state(module).items()
            }
        }
        if optimizer is None:
            return state
        base, sample, per_param = _optimizer_layout(optimizer)
        shared = {k: v for k, v in sample.items() if k not in per_param}  # Adam's step: one per group
        flat: dict[str, Any] = {}
        for name, param in params.items():
            if not param.requires_grad:
                continue
            for key in per_param:
                flat[f"state.{name}.{key}"] = safe_get_full_optimizer_state(param, key)
            for key, value in shared.items():
                flat[f"state.{name}.{key}"] = value.clone() if torch.is_tensor(value) else value
            group = self._groups[self._group_of.get(name, 0)]
            for key, value in group.items():
                if key != "params":
                    flat[f"param_groups.{name}.{key}"] = value
        state["optimizer"] = flat
        return state

    def load_state_dict(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        state: dict[str, Any],
        *,
        full: bool = False,
        strict: bool = True,
    ) -> None:
        module = self.unwrap(model)
        if not _partitioned(module):
            super().load_state_dict(module, optimizer, state, full=full, strict=strict)
            return
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        saved = state.get("model", {})
        params = dict(module.named_parameters())
        missing = [n for n in _named_state(module) if n not in saved]
        if strict and missing:
            raise KeyError(f"the checkpoint has no values for {missing[:5]} of this model")
        for name, value in _named_state(module).items():
            if name not in saved:
                continue
            if name not in params:  # a buffer: not partitioned
                value.copy_(saved[name])
                continue
            param = params[name]
            safe_set_full_fp32_param(param, saved[name])
            # the low-precision (or partitioned) copy the forward uses, from the same value
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                param.data.copy_(saved[name].to(param.dtype))
        flat = state.get("optimizer")
        if optimizer is None or not flat:
            return
        base, sample, per_param = _optimizer_layout(optimizer)
        for name, param in params.items():
            if not param.requires_grad:
                continue
            for key in per_param:
                safe_set_full_optimizer_state(param, flat[f"state.{name}.{key}"], key)
            group = self._groups[self._group_of.get(name, 0)]
            for key in group:
                if key != "params" and f"param_groups.{name}.{key}" in flat:
                    group[key] = flat[f"param_groups.{name}.{key}"]
        first = next(n for n, p in params.items() if p.requires_grad)
        for key in sample:  # the shared entries (Adam's step), the same in every group
            if key in per_param or f"state.{first}.{key}" not in flat:
                continue
            for entry in base.state.values():
                saved_value = flat[f"state.{first}.{key}"]
                if torch.is_tensor(entry[key]):
                    entry[key].copy_(saved_value)
                else:
                    entry[key] = saved_value


def _partitioned(module: nn.Module) -> bool:
    """Whether DeepSpeed keeps fp32 master weights apart from the module (ZeRO, or bf16/fp16)."""
    return any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id") for p in module.parameters())


def _named_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name, as ``state_dict`` lists them (without gathering)."""
    return dict(module.state_dict(keep_vars=True))


def _optimizer_layout(optimizer: Any) -> tuple[torch.optim.Optimizer, dict[str, Any], list[str]]:
    """(the torch optimizer DeepSpeed steps over its flat fp32 partitions, one entry of its state,
    the state keys shaped like a parameter), after giving a fresh optimizer its state."""
    base = getattr(optimizer, "optimizer", optimizer)
    _ensure_state(optimizer, base)
    sample = next(iter(base.state.values()))
    return base, sample, [k for k, v in sample.items() if torch.is_tensor(v) and v.dim() > 0]


def _ensure_state(optimizer: Any, base: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors so a checkpoint can be read into them.

    As torch's DCP does for a fresh optimizer: one step with zero gradients at learning rate 0,
    which creates the state without moving a weight; the loaded values then replace it.
    """
    if not base.state:
        flats = getattr(optimizer, "fp32_partitioned_groups_flat", None)
        if flats is None:  # ZeRO-1/2: each group holds its flat fp32 partition
            _zero_lr_step(base, [(group, group["params"]) for group in base.param_groups])
        else:  # ZeRO-3 lends each sub-group's partition to its group only while stepping
            groups = [base.param_groups[optimizer.sub_group_to_group_id[i]] for i in range(len(flats))]
            for group, flat in zip(groups, flats):
                kept = group["params"]
                _zero_lr_step(base, [(group, [flat])])
                group["params"] = kept
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2 map each parameter onto the state only after the first step
        link()


def _zero_lr_step(base: torch.optim.Optimizer, groups: list[tuple[dict[str, Any], list[torch.Tensor]]]) -> None:
    lrs = [group["lr"] for group, _ in groups]
    for group, params in groups:
        group["params"] = params
        group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
    base.step()
    for (group, params), lr in zip(groups, lrs):
        group["lr"] = lr
        for p in params:
            p.grad = None
