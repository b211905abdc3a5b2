"""The search's analytic plan against the dry run of the same plan (issue 34 item 1): for a grid of
(tp, activation checkpointing) plans of a small Llama, with sequence and loss parallelism where
tensor parallelism runs them, every collective's bytes and the parameters' bytes per rank agree
within 10% (the collectives to the byte here). The activation estimate is checked in
tests/test_plan_search.py's documented comparisons; where it and the dry run differ, kiln plan
--search --confirm dry-runs the first plan."""

from __future__ import annotations

import pytest
import torch

from kiln.config.args import load_trainer_args
from kiln.config.trainer_builder import build_model
from kiln.cost.devices import device_class
from kiln.planning.dry_run import dry_run
from kiln.planning.search import ModelShape, search
from test_dry_run import MICRO, SEQ, config

pytest.importorskip("transformers")
WORLD = 8


@pytest.mark.parametrize("tp, ac", [(2, "full"), (2, None), (4, "full"), (1, "full")])
def test_the_search_prices_what_the_dry_run_measures(tp, ac):
    cfg = config({"tp": tp, "dp_shard": -1} if tp > 1 else {"strategy": "fsdp"})
    cfg["activation_checkpointing"] = ac
    args = load_trainer_args(cfg, world_size=WORLD)
    measured = dry_run(args, WORLD).ranks[0]
    with torch.device("meta"):
        shape = ModelShape.from_model(build_model(args))
    assert shape.sequence_parallel
    dp = WORLD // tp
    result = search(shape, WORLD, device_class("h100"), budget=None, global_batch=MICRO * dp, seq_len=SEQ)
    (plan,) = [
        p
        for p in result.plans
        if (p.dp_shard, p.tp, p.pp, p.activation_checkpointing, p.micro_batch_size) == (dp, tp, 1, ac, MICRO)
    ]
    # the search names a mesh dimension's collectives as the dry run does; every kind it prices is measured
    for kind, dims in plan.collectives.items():
        for dim, estimated in dims.items():
            real = measured.collectives[kind][dim]
            assert abs(estimated - real) <= 0.10 * real, (kind, dim, estimated, real)
    priced = {(k, d) for k, dims in plan.collectives.items() for d in dims}
    assert priced == {(k, d) for k, dims in measured.collectives.items() for d in dims}
    assert abs(plan.memory["params"] - measured.params) <= 0.10 * measured.params
