"""The LM pretraining example and its YAML twin: a Llama-style model from a transformers config on the
standard library's sources, zero3 x tp on 4 real processes, with compile and activation checkpointing."""

from __future__ import annotations

import re

import pytest

from distributed import ROOT, check, fork_run

pytest.importorskip("transformers")

# One layer: compile, full activation checkpointing, zero3 and tp apply to each block alike, so a second
# proves nothing more; 2 -> 1 layer cut the launch from ~38 to ~31-33 CPU-s (measured alone)
SMALL = ["--steps", "4", "--seq-len", "32", "--hidden", "32", "--layers", "1", "--batch-size", "2"]


@pytest.mark.world_size(4)
def test_python_example_zero3_x_tp_compiled_and_checkpointed(tmp_path):
    result = check(
        fork_run(
            ROOT / "examples" / "lm_pretrain.py",
            *SMALL,
            "--max-bytes",
            "60000",
            "--peak-tflops",
            "1",
            nproc=4,
            timeout=600,
            cwd=tmp_path,
        )
    )
    line = [line for line in result.stdout.splitlines() if line.startswith("lm_pretrain:")]
    assert len(line) == 1, result.stdout  # rank 0 only
    assert "4 ranks, strategy hybrid" in line[0]
    values = dict(re.findall(r"(\S+) ([-+0-9.e]+)(?:,|$)", line[0].split("hybrid, ", 1)[1]))
    assert 0 < float(values["train/loss"]) < 5.6  # below ln(256) = 5.55 + noise: it learned something
    assert float(values["throughput/tokens_per_sec"]) > 0 and 0 < float(values["throughput/mfu"]) < 1


# The YAML twin trains under the config CLI in tests/test_hygiene.py (one launch for both checks).


@pytest.mark.parametrize("tp", [1, 2])
def test_yaml_and_script_choose_the_same_strategy_at_world_size_2(tp, monkeypatch):
    # dp_shard: -1 in a run file selects the hybrid mesh (the rest of the world shards: zero3),
    # as the script's Hybrid(dp_shard=-1) does; before, with tp 1 the YAML fell back to auto (DDP)
    from types import SimpleNamespace

    from kiln.config.args import load_trainer_args
    from kiln.config.trainer_builder import _strategy
    from kiln.parallel.state.mesh import ParallelDims

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.syspath_prepend(str(ROOT))
    from lm_pretrain import choose_strategy

    args = load_trainer_args(ROOT / "examples" / "lm_pretrain.yaml", ["--compute_config.tp", str(tp)], world_size=2)
    from_yaml = _strategy(args, SimpleNamespace(world_size=2, rank=0))
    from_script = choose_strategy(2, tp)
    assert repr(from_yaml) == repr(from_script), (from_yaml, from_script)
    assert from_yaml.dims.resolve(2) == from_script.dims.resolve(2) == ParallelDims(dp_shard=2 // tp, tp=tp)


def test_yaml_and_script_train_the_same_schedule(monkeypatch):
    # the run file names kiln's time-aware cosine (which takes no optimizer: the config CLI could
    # not build one before) with the script's settings
    import torch

    from kiln.config.args import load_trainer_args
    from kiln.config.trainer_builder import build_scheduler

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.syspath_prepend(str(ROOT))
    from lm_pretrain import schedule

    args = load_trainer_args(ROOT / "examples" / "lm_pretrain.yaml", world_size=4)
    from_yaml = build_scheduler(args, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    from_script = schedule()
    assert type(from_yaml) is type(from_script) and vars(from_yaml) == vars(from_script)


def test_dp_shard_selects_the_hybrid_mesh_only_when_set():
    import yaml

    from kiln.config.args import TrainerArgs, dump_yaml, load_trainer_args

    base = yaml.safe_load((ROOT / "examples" / "lm_pretrain.yaml").read_text())

    def loaded(**cc):
        return load_trainer_args({**base, "compute_config": cc}, world_size=2, check=False)

    unset = loaded()
    assert unset.compute_config.dp_shard is None  # left to the strategy: auto
    assert unset.compute_config.strategy_name(unset.pas_policy, 2) == "auto"
    for cc in ({"dp_shard": -1}, {"dp_shard": 2}, {"tp": 2}, {"strategy": "hybrid"}):
        args = loaded(**cc)
        assert args.compute_config.strategy_name(args.pas_policy, 2) == "hybrid", cc
        assert args.compute_config.dp_shard == cc.get("dp_shard", -1)  # filled in for the mesh
    # a printed config reads back to the same choice
    for args in (unset, loaded(dp_shard=-1)):
        again = TrainerArgs.from_dict(yaml.safe_load(dump_yaml(args))).compute_config
        assert again.strategy_name(args.pas_policy, 2) == args.compute_config.strategy_name(args.pas_policy, 2)
