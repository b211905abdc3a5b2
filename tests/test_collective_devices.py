"""Every tensor collective kiln issues is on ``kiln.context().device``: NCCL (what every GPU user
gets) refuses CPU tensors, gloo takes both, so a hard-coded ``.cpu()`` passes every CPU test.

Two checks:

* a real 2-rank gloo run (Trainer, eval, OOM vote, NaNMonitor, logger, nnScaler's GradReduction,
  preemption check, Colossal-AI metric hooks) with torch.distributed's tensor collectives wrapped:
  every call made on behalf of kiln code is on the context's device (or is a CPU tensor on an
  explicitly gloo group), and every known call site was reached;
* the call sites that pick a device themselves, in one process whose context claims an
  accelerator (``meta``) in a world of 2 faked at the torch.distributed functions: the collective
  they reach records its tensors' devices and stops the call. On a CPU machine this is what shows
  a CPU tensor where the backend would need the accelerator's.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
import torch.distributed as dist

from distributed import WORKERS, check, fork_run
from workers.collective_trace import TENSOR_COLLECTIVES, kiln_site, tensors_in

_context = importlib.import_module("kiln.launch.context")  # the module: kiln.launch.context is also a function name


# -- the real two-rank run ------------------------------------------------------------------------
SITES = {
    "trainer/options.py",
    "trainer/trainer.py",
    "trainer/evaluation.py",
    "callbacks/nan_monitor.py",
    "hooks/metrics.py",
    "config/reduction.py",
    "checkpoint/preemption.py",
}


@pytest.mark.timeout(240)
def test_every_kiln_collective_of_a_two_rank_run_is_on_the_context_device(tmp_path):
    check(fork_run(WORKERS / "collective_devices.py", str(tmp_path), timeout=200))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        wrong = [call for call in result["calls"] if not call[3]]
        assert not wrong, f"rank {rank}: collectives off {result['device']}: {wrong}"
        reached = {call[2].split(":")[0] for call in result["calls"]}
        assert SITES <= reached, f"rank {rank}: call sites not reached: {SITES - reached}"
        assert result["accuracy"]["count"] == pytest.approx(result["accuracy"]["torchmetrics"], abs=1e-7)


# -- one process whose context claims an accelerator ----------------------------------------------
class Reached(Exception):
    """Raised by a faked collective: the call site got as far as the collective."""

    def __init__(self, op: str, devices: list[torch.device], site: str | None) -> None:
        super().__init__(f"{op} of tensors on {devices} from {site}")
        self.op, self.devices, self.site = op, devices, site


@pytest.fixture
def accelerator_world():
    """A world of 2 on the ``meta`` device, as far as kiln and torchmetrics can tell."""
    from kiln.launch.context import Context

    device = torch.device("meta")

    def faked(op):
        def collective(*args, **kwargs):
            values = [*args, *kwargs.values()]
            raise Reached(op, [t.device for t in tensors_in(values)], kiln_site())

        return collective

    # undone before conftest's clean-up, which asks torch.distributed whether a group exists
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "is_initialized", lambda: True)
        patch.setattr(dist, "get_world_size", lambda group=None: 2)
        patch.setattr(dist, "get_rank", lambda group=None: 0)
        patch.setattr(dist, "get_backend", lambda group=None: "nccl")
        patch.setattr(dist, "barrier", lambda *args, **kwargs: None)
        for op in TENSOR_COLLECTIVES:
            if hasattr(dist, op):
                patch.setattr(dist, op, faked(op))
        _context._set_context(Context(rank=0, world_size=2, device=device, backend="nccl"))
        yield device
    _context._set_context(None)


def _reach(fn) -> Reached:
    with pytest.raises(Reached) as info:
        fn()
    return info.value


def _loss_metric(device):
    from kiln.hooks.metrics import LossMetric

    metric = LossMetric()
    metric.update(torch.tensor(0.5, device=device))
    return metric


def _count_accuracy(device):
    from kiln.hooks.metrics import AccuracyMetric

    metric = AccuracyMetric(lambda out, label: (out.argmax(-1) == label).sum())
    metric.update(torch.zeros(4, 3, device=device), torch.zeros(4, dtype=torch.long, device=device))
    return metric


def _torchmetrics_accuracy(device):
    from kiln.hooks.metrics import AccuracyMetric
    from kiln.metrics import Accuracy

    metric = AccuracyMetric(Accuracy())
    metric.update(torch.zeros(4, 3, device=device), torch.zeros(4, dtype=torch.long, device=device))
    return metric


def _throughput(device):
    from kiln.hooks.metrics import ThroughputMetric

    metric = ThroughputMetric()
    metric.update(8, 0.5)
    return metric


@pytest.mark.parametrize(
    "make",
    [_loss_metric, _count_accuracy, _torchmetrics_accuracy, _throughput],
    ids=["loss", "accuracy-count", "accuracy-torchmetrics", "throughput"],
)
def test_colossal_hook_metrics_sum_over_ranks_on_the_context_device(accelerator_world, make):
    metric = make(accelerator_world)
    reached = _reach(metric.get_accumulated_value)
    assert reached.devices and all(d == accelerator_world for d in reached.devices), reached


def test_auto_microbatch_oom_vote_is_on_the_context_device(accelerator_world):
    from kiln.trainer.options import MicrobatchOptions

    reached = _reach(lambda: MicrobatchOptions().any_rank_oom(False))
    assert reached.devices == [accelerator_world], reached


def test_nnscaler_loss_aggregation_is_on_the_context_device(accelerator_world):
    from kiln.config.reduction import AggregatedOutputs

    reached = _reach(lambda: AggregatedOutputs.aggregate([torch.tensor(1.5)], None))
    assert reached.devices == [accelerator_world], reached


def test_pipeline_grad_norm_of_a_stage_without_gradients_is_on_the_context_device(accelerator_world):
    from kiln.parallel.state.grad_norm import total_grad_norm

    params = [torch.nn.Parameter(torch.zeros(2))]  # no .grad: a frozen stage still joins the all-reduce
    reached = _reach(lambda: total_grad_norm(params, 2.0, pp_group=object()))
    assert reached.devices == [accelerator_world], reached


def test_nan_monitor_check_is_on_the_state_device(accelerator_world):
    from kiln.callbacks import NaNMonitor
    from kiln.core.state import State

    state = State(torch.nn.Linear(1, 1), rank=0, world_size=2, device=accelerator_world)
    reached = _reach(lambda: NaNMonitor()._check(state, None))
    assert reached.devices == [accelerator_world], reached
