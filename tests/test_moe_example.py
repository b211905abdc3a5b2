"""The MoE pretraining example (examples/moe_pretrain.py), the Python twin of moe_pretrain.yaml:
MoELlama on the standard library's sources, EP 2 x FSDP 2 on 4 real processes, a few steps at
small dimensions. The YAML twin trains under the config CLI in tests/test_hygiene.py."""

from __future__ import annotations

import re
from types import SimpleNamespace

from distributed import ROOT, check, fork_run
from kiln.parallel.state.mesh import ParallelDims

SMALL = ["--steps", "4", "--seq-len", "32", "--hidden", "32", "--layers", "2", "--batch-size", "2"]


def test_python_example_ep2_x_fsdp2_trains_and_logs_the_router(tmp_path):
    result = check(
        fork_run(
            ROOT / "examples" / "moe_pretrain.py",
            *SMALL,
            "--max-bytes",
            "20000",
            "--log-every",
            "2",
            nproc=4,
            timeout=600,
            cwd=tmp_path,
        )
    )
    line = [line for line in result.stdout.splitlines() if line.startswith("moe_pretrain:")]
    assert len(line) == 1, result.stdout  # rank 0 only
    assert "4 ranks, Hybrid(" in line[0] and "ep=2)" in line[0]
    values = dict(re.findall(r"(\S+) ([-+0-9.e]+)(?:,|$)", line[0].split(")", 1)[1]))
    assert float(values["train/loss"]) < float(values["first/loss"])  # the loss falls
    assert 1.0 <= float(values["moe/imbalance"]) < 8  # busiest of 8 experts over the mean: logged, finite
    assert float(values["throughput/tokens_per_sec"]) > 0
    # the router statistics were logged by MoEMonitor on its interval (batches 2 and 4)
    assert len(re.findall(r"\[batch [24]\] .*moe/tokens_per_expert/7: \d+", result.stdout)) == 2, result.stdout
    assert list(tmp_path.iterdir()) == []  # the script writes nothing


def test_yaml_and_script_choose_the_same_strategy(monkeypatch):
    from kiln.config.args import load_trainer_args
    from kiln.config.trainer_builder import _strategy

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.syspath_prepend(str(ROOT))
    from moe_pretrain import choose_strategy

    args = load_trainer_args(ROOT / "examples" / "moe_pretrain.yaml", [], world_size=4)
    from_yaml = _strategy(args, SimpleNamespace(world_size=4, rank=0))
    from_script = choose_strategy(4, 2)
    assert repr(from_yaml) == repr(from_script), (from_yaml, from_script)
    assert from_yaml.dims.resolve(4) == from_script.dims.resolve(4) == ParallelDims(dp_shard=4, ep=2)
