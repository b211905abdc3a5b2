"""The parallelize pipeline: one documented order of model transformations, the steps each strategy
declares, the seams for compile / activation checkpointing / float8, the mesh checked first.

The one-process tests call ``setup`` with a world of 1 (no process group: a collective would fail);
one 2-rank launch (workers/parallelize_worker.py) records what every strategy did to the model.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch import nn

import kiln
import kiln.parallel.transforms.parallelize as parallelize_module
from distributed import WORKERS, check, fork_run
from kiln.launch.context import Context
from kiln.parallel import FSDP, Hybrid, SingleDevice, Strategy, TensorParallel
from kiln.parallel.strategy import _BUILTIN, _lookup
from kiln.parallel.transforms.parallelize import STAGE_STEPS, STEPS, WHOLE_MODEL_STEPS, ParallelizeOptions, find_blocks
from kiln.precision import get_precision

sys.path.insert(0, str(WORKERS))  # the shared test model and the recording strategy live beside the workers
from parallel_model import PLAN, make_model  # noqa: E402
from parallelize_worker import recording  # noqa: E402

ONE_DEVICE = ["placement", "float8", "activation_checkpointing", "compile"]
DATA_PARALLEL = [*ONE_DEVICE, "data_parallel"]
DECLARED = {
    "single": ONE_DEVICE,
    "ddp": DATA_PARALLEL,
    "zero1": DATA_PARALLEL,
    "zero2": DATA_PARALLEL,
    "zero3": DATA_PARALLEL,
    "fsdp": DATA_PARALLEL,
    "tp": ["placement", "float8", "tensor_parallel", "activation_checkpointing", "compile"],
    "pp": ONE_DEVICE,
    "hybrid": list(STEPS),
    "deepspeed": [],  # deepspeed.initialize places, casts and wraps
}
SEAM_VALUES = [
    ("compile", True),
    ("compile", {"mode": "max-autotune"}),
    ("activation_checkpointing", "full"),
    ("activation_checkpointing", lambda module: True),
]
# compile and activation checkpointing: tests/test_levers.py; float8: below and tests/test_float8.py


def _setup(strategy, *, precision="fp32", world_size=1, optimizer=True):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    return model, strategy.setup(model, opt, Context(rank=0, world_size=world_size), get_precision(precision))


# -- the order ------------------------------------------------------------------------------------
def test_the_documented_order():
    assert STEPS == (
        "placement",
        "float8",
        "tensor_parallel",
        "expert_parallel",
        "activation_checkpointing",
        "compile",
        "data_parallel",
    )
    assert WHOLE_MODEL_STEPS + STAGE_STEPS == STEPS and WHOLE_MODEL_STEPS == ("placement", "float8")
    doc = parallelize_module.__doc__
    positions = [doc.index(f"``{step}``") for step in STEPS]
    assert positions == sorted(positions), "the module docstring's table lists the steps in another order"
    assert doc.index("(pipeline cut)") == sorted([*positions, doc.index("(pipeline cut)")])[2]


def test_steps_run_in_the_documented_order_whatever_order_they_are_declared_in():
    class Everything(Strategy):
        name = "everything"
        steps = tuple(reversed(STEPS))

    strategy = recording(Everything)
    model, (out, _) = _setup(strategy)
    assert [step for step, _ in strategy.calls] == list(STEPS)
    assert all(module is model for _, module in strategy.calls) and out is model


# -- what each strategy applies -----------------------------------------------------------------
def test_every_strategy_declares_its_steps():
    assert set(DECLARED) == set(_BUILTIN) - {"auto"}  # auto applies what the strategy it picks declares
    for name, steps in DECLARED.items():
        assert list(_lookup(name).steps) == steps, name


@pytest.mark.parametrize(
    "name, make",
    [
        ("single", lambda: recording(SingleDevice)),
        ("ddp", lambda: recording(_lookup("ddp"))),
        ("zero1", lambda: recording(_lookup("zero1"))),
        ("zero2", lambda: recording(_lookup("zero2"))),
        ("zero3", lambda: recording(_lookup("zero3"))),
        ("tp", lambda: recording(TensorParallel, PLAN)),
        ("hybrid", lambda: recording(Hybrid, tp_plan=PLAN)),
    ],
)
def test_one_rank_runs_the_declared_steps_and_only_places(name, make):
    # on one rank the wrapping steps run and leave the model alone; placement casts it in place
    strategy = make()
    model, (out, opt) = _setup(strategy, precision="bf16")
    assert [step for step, _ in strategy.calls] == DECLARED[name]
    assert out is model and type(out) is type(make_model())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(type(p) is nn.Parameter for p in model.parameters())  # no DTensor
    assert opt.param_groups[0]["params"][0] is next(model.parameters())


# -- the seams ------------------------------------------------------------------------------------
def test_seams_with_none_do_nothing():
    assert ParallelizeOptions(compile=False, activation_checkpointing=False, float8=False) == ParallelizeOptions()
    reference = make_model()
    model, (out, _) = _setup(SingleDevice())
    assert out is model and type(out) is type(reference)
    assert [type(m) for m in out.modules()] == [type(m) for m in reference.modules()]
    assert list(out.state_dict()) == list(reference.state_dict())  # no _orig_mod., no checkpoint wrapper
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in out.modules())
    for a, b in zip(out.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_float8_on_the_cpu_is_refused_in_one_line_and_converts_when_emulated():
    pytest.importorskip("torchao.float8")
    for strategy in (SingleDevice(), kiln.parallel.Auto(memory_budget=1e12)):  # Auto hands it on
        strategy.parallelize_options = ParallelizeOptions(float8=True)
        with pytest.raises(ValueError, match=r"^float8 training needs an NVIDIA GPU .* this run is on cpu") as info:
            _setup(strategy)
        assert "\n" not in str(info.value)
    strategy = SingleDevice()
    strategy.parallelize_options = ParallelizeOptions(float8={"emulate": True})
    model = make_model()
    keys = list(model.state_dict())
    strategy.setup(model, torch.optim.AdamW(model.parameters()), Context(rank=0, world_size=1), get_precision("fp32"))
    converted = [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
    eligible = [
        n
        for n, m in make_model().named_modules()
        if isinstance(m, nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
    ]
    assert converted == eligible and list(model.state_dict()) == keys
    with pytest.raises(ValueError, match=r"^float8 recipe='x': expected one of"):
        ParallelizeOptions(float8={"recipe": "x"})


@pytest.mark.parametrize("option, value", SEAM_VALUES)
def test_the_filled_seams_apply_in_place_and_keep_every_name(option, value):
    from kiln.parallel.transforms.levers import applied_levers

    for strategy in (SingleDevice(), kiln.parallel.Auto(memory_budget=1e12)):  # Auto hands them on
        strategy.parallelize_options = ParallelizeOptions(**{option: value})
        model, (out, opt) = _setup(strategy)
        assert out is model and list(model.state_dict()) == list(make_model().state_dict())
        assert [applied_levers(block) for block in model.blocks] == [[option]] * len(model.blocks)
        assert opt.param_groups[0]["params"][0] is next(model.parameters())


def test_an_option_the_strategy_does_not_apply_is_refused():
    class PlaceOnly(Strategy):
        name = "place_only"
        steps = ("placement",)

    strategy = recording(PlaceOnly)
    strategy.parallelize_options = ParallelizeOptions(compile=True)
    with pytest.raises(
        ValueError,
        match=r"^compile=True is not applied under strategy='place_only': its steps are "
        r"placement; leave compile=None with this strategy$",
    ):
        _setup(strategy)
    assert strategy.calls == []  # refused before any step ran


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"activation_checkpointing": "fulll"},
            r"activation_checkpointing='fulll' must be 'full', 'selective' \(keeps matmul outputs\), "
            r"'selective:N' \(every Nth block\), a callable",
        ),
        ({"activation_checkpointing": "selective:0"}, r"activation_checkpointing='selective:0' must be"),
        ({"compile": "yes"}, r"compile='yes' must be True, a dict of settings, or None"),
        ({"compile": {"mdoe": "max-autotune"}}, r"compile=\{'mdoe': 'max-autotune'\} has 'mdoe', which torch"),
        ({"float8": 1}, r"float8=1 must be True, a dict of settings, or None"),
    ],
)
def test_option_values_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelizeOptions(**kwargs)


def test_a_step_name_that_is_not_a_step():
    class Typo(Strategy):
        name = "typo"
        steps = ("placement", "compiel")

    with pytest.raises(
        ValueError,
        match=r"Typo.steps names \['compiel'\], which are not steps; the steps are "
        r"placement, float8, tensor_parallel",
    ):
        _setup(Typo())


# -- the mesh, checked before anything happens ----------------------------------------------------
@pytest.mark.parametrize(
    "make, world, bad",
    [
        (lambda: recording(Hybrid, tp=3, tp_plan=PLAN), 4, "tp=3"),
        (lambda: recording(Hybrid, dp_shard=3), 4, "dp_shard=3"),
        (lambda: recording(Hybrid, dp_replicate=3), 2, "dp_replicate=3"),
    ],
)
def test_a_mesh_that_does_not_fit_the_world_is_one_line_naming_the_size(make, world, bad):
    strategy = make()
    with pytest.raises(ValueError) as info:
        _setup(strategy, world_size=world)
    message = str(info.value)
    assert "\n" not in message and bad in message, message
    assert f"world of {world} processes" in message or f"world has {world} processes" in message, message
    assert strategy.calls == []  # no step ran: the model was not even moved


# -- the blocks ----------------------------------------------------------------------------------
def test_blocks_are_the_indexed_layers_or_what_wrap_names():
    model = make_model()
    blocks = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert find_blocks(model) == blocks
    assert find_blocks(model, "Block") == blocks == find_blocks(model, type(model.blocks[0]))
    assert find_blocks(model, ["blocks.1", "head"]) == ["blocks.1", "head"]
    assert find_blocks(nn.Sequential(nn.ReLU(), nn.Linear(2, 2))) == ["1"]  # only modules with parameters
    assert find_blocks(nn.Linear(2, 2)) == []


def test_the_plan_carries_the_blocks_fsdp_wraps():
    ctx, fp32 = Context(), get_precision("fp32")
    assert SingleDevice().parallelize_plan(make_model(), ctx, fp32).blocks == find_blocks(make_model())
    assert FSDP(wrap="blocks.1").parallelize_plan(make_model(), ctx, fp32).blocks == ["blocks.1"]
    assert Hybrid(wrap="Block").parallelize_plan(make_model(), ctx, fp32).blocks == find_blocks(make_model())


# -- overriding one step -------------------------------------------------------------------------
def test_a_strategy_that_overrides_only_one_step():
    class Float64(SingleDevice):
        name = "float64"

        def apply_placement(self, model, plan):
            return super().apply_placement(model, plan).double()

    strategy = recording(Float64)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    engine = kiln.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), strategy=strategy)
    assert [step for step, _ in strategy.calls] == ONE_DEVICE
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    before = model[0].weight.detach().clone()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()
    assert not torch.equal(before, model[0].weight)


# -- two ranks: what each strategy did ------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("parallelize")
    check(fork_run(WORKERS / "parallelize_worker.py", str(out), nproc=2, timeout=300))
    return json.loads((out / "parallelize.json").read_text())


BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
PLAIN = {"inp.weight": None, "blocks.0.fc1.weight": None, "blocks.0.fc2.weight": None}
FSDP_SHARDS = {
    "inp.weight": ["S(0)", "dp_shard"],
    "blocks.0.fc1.weight": ["S(0)", "dp_shard"],
    "blocks.0.fc2.weight": ["S(0)", "dp_shard"],
}
TP_SHARDS = {"inp.weight": None, "blocks.0.fc1.weight": ["S(0)", "tp"], "blocks.0.fc2.weight": ["S(1)", "tp"]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "case, declared, wrapper, sharded, weights, optimizer, data_parallel",
    [
        ("ddp", "ddp", "DistributedDataParallel", [], PLAIN, "AdamW", True),
        ("zero1", "zero1", "DistributedDataParallel", [], PLAIN, "ZeroRedundancyOptimizer", True),
        ("zero3", "zero3", "FSDPNet", ["", *BLOCKS], FSDP_SHARDS, "AdamW", True),
        ("tp", "tp", "Net", [], TP_SHARDS, "AdamW", False),
        ("hybrid_tp", "hybrid", "Net", [], TP_SHARDS, "AdamW", False),
        ("hybrid_fsdp", "hybrid", "FSDPNet", ["", *BLOCKS], FSDP_SHARDS, "AdamW", True),
        ("root_only_fsdp", "zero3", "FSDPNet", [""], FSDP_SHARDS, "AdamW", True),
    ],
)
def test_two_ranks_each_strategy_applies_its_steps(
    two_ranks, case, declared, wrapper, sharded, weights, optimizer, data_parallel
):
    for rank, facts in enumerate(two_ranks[case]):
        assert facts["calls"] == [[step, "model"] for step in DECLARED[declared]], (case, rank)
        assert facts["wrapper"] == wrapper and facts["wraps_the_model"], (case, rank)
        assert facts["sharded"] == sharded, (case, rank)
        weights_seen = {k: v for k, v in facts["placements"].items() if k.endswith("weight")}
        assert weights_seen == weights, (case, rank)
        assert facts["optimizer"] == optimizer and facts["optimizer_follows"], (case, rank)
        assert facts["data_parallel"] == ([rank, 2] if data_parallel else [0, 1]), (case, rank)


@pytest.mark.world_size(2)
def test_two_ranks_pipeline_cuts_between_the_whole_model_and_the_stage_steps(two_ranks):
    for facts in two_ranks["pp"]:
        assert facts["calls"] == [
            ["placement", "model"],
            ["float8", "model"],
            ["activation_checkpointing", "stage"],
            ["compile", "stage"],
        ]
        assert facts["wrapper"] == "PipelineModule" and facts["optimizer_follows"]


@pytest.mark.world_size(2)
def test_two_ranks_overriding_one_step_trains_like_the_step_it_replaced(two_ranks):
    assert two_ranks["root_only_vs_zero3"] < 1e-12
