"""Bad parallel input fails with a clear error before any collective: these run with no process
group at all, so a collective (or a mesh) would fail differently."""

from __future__ import annotations

import sys

import pytest
import torch

import kiln
from distributed import WORKERS  # noqa: E402
from kiln.launch.context import Context
from kiln.parallel import FSDP, Hybrid, ParallelDims, Pipeline, TensorParallel, get_strategy
from kiln.precision import get_precision

sys.path.insert(0, str(WORKERS))  # the shared test model lives beside the workers
from parallel_model import make_model  # noqa: E402


def _setup(strategy, world_size):
    model = make_model()
    ctx = Context(rank=0, world_size=world_size)
    return strategy.setup(model, torch.optim.AdamW(model.parameters()), ctx, get_precision("fp32"))


@pytest.mark.parametrize(
    "strategy,world,message",
    [
        (
            Hybrid(dp_shard=3),
            4,
            r"multiply to 3 but the world has 4 processes; make pp\*dp_replicate\*dp_shard\*tp equal 4",
        ),
        (Hybrid(tp=3), 4, r"do not divide the world of 4 processes: pp\*dp_replicate\*tp = 3 must divide 4"),
        (Hybrid(dp_replicate=2, tp=2, pp=2, split_points=["blocks.2"]), 4, r"multiply to 8|do not divide"),
    ],
)
def test_mesh_that_does_not_divide_the_world(strategy, world, message):
    with pytest.raises(ValueError, match=message):
        _setup(strategy, world)


def test_tp_plan_naming_a_missing_module():
    message = r"plan key 'blocks\.\*\.fc9' names no module of Net \(its top-level modules: inp, blocks, head\)"
    with pytest.raises(ValueError, match=message):
        _setup(TensorParallel({"blocks.*.fc1": "colwise", "blocks.*.fc9": "rowwise"}), 2)


@pytest.mark.parametrize(
    "plan,message",
    [
        ({"blocks.*.fc1": "diagonal"}, r"plan\['blocks\.\*\.fc1'\]='diagonal' is not a style; expected one of colwise"),
        ({"blocks.0": "colwise"}, r"selects 'blocks\.0', a Block; colwise splits only nn\.Linear and nn\.Embedding"),
    ],
)
def test_tp_plan_bad_style_or_target(plan, message):
    with pytest.raises(ValueError, match=message):
        _setup(TensorParallel(plan), 2)


def test_tp_without_plan_uses_the_model_attribute_or_says_what_to_do():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="TensorParallel\\(plan=None\\) needs a plan"):
        TensorParallel().setup(model, None, Context(world_size=2), get_precision("fp32"))


def test_hybrid_tp_plan_naming_a_missing_module():
    with pytest.raises(ValueError, match="names no module"):
        _setup(Hybrid(dp_shard=2, tp=2, tp_plan={"mlp.fc1": "colwise"}), 4)


@pytest.mark.parametrize(
    "strategy,message",
    [
        (Pipeline(["blocks.9"]), r"split point 'blocks\.9' is not a module of Net; .*did you mean 'blocks\.3'"),
        (Pipeline(["blocks.1", "blocks.2"]), r"2 split points make 3 stages for 2 pipeline ranks; give 1 split points"),
        (Pipeline(["blocks.2"], schedule="interleaved1f1b"), r"needs at least 2 stages per rank"),
        (Hybrid(pp=2, dp_shard=2, split_points=["block.2"]), r"split point 'block\.2' is not a module"),
    ],
)
def test_pipeline_split_point_that_does_not_exist(strategy, message):
    world = 4 if isinstance(strategy, Hybrid) else 2
    with pytest.raises(ValueError, match=message):
        _setup(strategy, world)


def test_pipeline_options():
    with pytest.raises(
        ValueError, match="schedule='zigzag' is not known; expected one of gpipe, 1f1b, interleaved1f1b"
    ):
        Pipeline(["blocks.2"], schedule="zigzag")
    with pytest.raises(ValueError, match="needs split_points"):
        Pipeline([])
    with pytest.raises(ValueError, match="microbatches=0 must be an integer >= 1"):
        Pipeline(["blocks.2"], microbatches=0)


def test_fsdp_wrap_matching_nothing():
    with pytest.raises(
        ValueError, match=r"FSDP wrap='Blok' matches no module of the model; its module classes are Block"
    ):
        _setup(FSDP(wrap="Blok"), 2)


def test_parallel_dims_validate_types():
    with pytest.raises(ValueError, match=r"parallel dimension tp=0 must be an integer >= 1"):
        ParallelDims(tp=0)
    assert ParallelDims(dp_shard=-1, tp=2).resolve(8) == ParallelDims(dp_shard=4, tp=2)
    assert ParallelDims(dp_replicate=2, dp_shard=1).resolve(2).mesh_shape() == ((2, 1), ("dp_replicate", "dp_shard"))


def test_deepspeed_missing_names_the_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ImportError, match="strategy='deepspeed' needs the 'deepspeed' package, which is not installed"):
        get_strategy("deepspeed", deepspeed_config={"train_micro_batch_size_per_gpu": 1})


def test_one_rank_strategies_stay_plain():
    # FSDP, zero1 and tp on one process add nothing: the model and optimizer come back as they were.
    for name in ("zero1", "zero2", "zero3", "tp"):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters())
        m, o = get_strategy(name).setup(model, opt, Context(), get_precision("fp32"))
        assert m is model and o is opt, name
    assert type(get_strategy("auto", Context())).__name__ == "SingleDevice"
    assert kiln.parallel.strategy_names() == [
        "auto",
        "ddp",
        "deepspeed",
        "fsdp",
        "hybrid",
        "pp",
        "single",
        "tp",
        "zero1",
        "zero2",
        "zero3",
    ]


def test_zero1_tells_a_scheduler_on_the_users_optimizer_that_it_stepped(tmp_path):
    # ZeRO rebuilds the optimizer; a torch LR scheduler built on the user's optimizer checks, at its
    # first step, that this optimizer stepped first: without the mark every rank warned
    # "Detected call of `lr_scheduler.step()` before `optimizer.step()`" although the order was right.
    import warnings

    import torch.distributed as dist

    from kiln.parallel.zero import shard_optimizer

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )  # the conftest destroys it
    model = torch.nn.Linear(4, 2)
    user = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(user, step_size=1, gamma=0.5)
    zero = shard_optimizer(user)
    model(torch.ones(3, 4)).sum().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero.step()
        scheduler.step()
    assert [str(w.message) for w in caught if "lr_scheduler" in str(w.message)] == []
    assert zero.param_groups[0]["lr"] == 0.05  # the scheduler still sets ZeRO's rate
