"""`MoEMonitor`: log the routing of a model's mixture-of-experts layers, and balance them by bias."""

from __future__ import annotations

from typing import Any

from kiln.core.callback import Callback
from kiln.core.state import State

__all__ = ["MoEMonitor"]


class MoEMonitor(Callback):
    """Router statistics of the model's :class:`kiln.models.MoE` layers, and their bias balancing.

    After every optimizer step (``BATCH_END``) it applies DeepSeek-V3's bias update to the layers
    with ``load_balance="bias"`` (:func:`kiln.models.moe.update_expert_bias`: one all-reduce of
    the step's token counts for all layers). Every ``interval`` batches it logs
    :func:`kiln.models.moe.router_stats`: ``moe/tokens_per_expert/<i>`` (this rank's (token,
    expert) pairs since the last log, summed over layers), ``moe/imbalance`` (the busiest expert's
    pairs over the mean, the largest over layers; 1.0 is balanced), ``moe/imbalance/<layer>`` and,
    with a capacity, ``moe/dropped_tokens``. The counts are kept on the device between logs: the
    logger reads them once per log, no step waits for the device.

    Args:
        interval: log every this many batches.

    Example::

        trainer = kiln.Trainer(kiln.models.MoELlama(num_experts=8), ...,
                               callbacks=[kiln.callbacks.MoEMonitor(interval=10)])
    """

    def __init__(self, interval: int = 1) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"MoEMonitor interval={interval!r} must be an integer >= 1 (batches between logs)")
        self.interval = interval

    def batch_end(self, state: State, logger: Any) -> None:
        from kiln.models.moe import router_stats, update_expert_bias

        update_expert_bias(state.model)
        if state.timestamp.batch.value % self.interval == 0:
            metrics = router_stats(state.model)
            if metrics:
                logger.log_metrics(metrics)
