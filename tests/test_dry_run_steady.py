"""A pipeline dry run measures a run's steady step without running a whole step first, and its
ranks measured side by side in forked workers report what they report one after another.

A pipeline builds its stages on its first batch and its schedule sets itself up in its first step
(receive buffers, the warm-up exchange with the neighbouring stages). The dry run used to run that
first step whole and measure the second (a third of a 70B rank's time); now the batch builds the
stages and sets up the schedule with no microbatch run
(kiln.parallel.pipelining.runtime.PipelineRuntime.setting_up), and the first step is measured.
Checked here against the old way, on the same rank: a first step run whole, then the second
measured; every number of the report equal, for a single-stage (1F1B) and a multi-stage
(interleaved 1F1B) schedule under Hybrid(pp=2, dp_shard=2). Broken on purpose: with the schedule's setup skipped (``set_up_stages`` running no
``_initialize_stage``), the measured 1F1B step sets the schedule up itself and the test fails:
p2p 16,392 B instead of 16,384 (the warm-up's 8), activations 132,900 B instead of 124,708 (the
receive buffers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
from pathlib import Path

import pytest

import kiln.planning.dry_run as dry_run_module
import kiln.planning.rank_workers as rank_workers
from kiln.config.args import load_trainer_args
from kiln.planning.dry_run import _engine, _loss_of, dry_run, first_microbatch, measure_step, mesh_sizes
from kiln.planning.shared_trace import one_trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # lm_data

pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def _stdlib_read_once():
    """lm_data's text of the standard library walks the whole stdlib tree each time: read once."""
    import lm_data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_data, "stdlib_bytes", functools.cache(lm_data.stdlib_bytes))
        yield


def _args(schedule: str, compute: dict):
    layers = 2 if schedule == "1f1b" else 4  # a layer a stage: 2 stages, or 4 in 2 a rank
    splits = [f"model.model.layers.{i}" for i in range(1, layers)]
    model = dict(
        model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    run = {
        "compute_config": {
            **compute,
            "strategy_options": {"schedule": schedule, "microbatches": 4, "split_points": splits},
        },  # fmt: skip
        "micro_batch_size": 4,
        "max_train_steps": 1,
        "precision": "amp_bf16",
        "activation_checkpointing": "full",
        "model": {"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": model}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 1e-3}},
        "dataset": {"type": "lm_data.StdlibText.from_stdlib", "train_args": {"seq_len": 16, "max_bytes": 20000}},
    }
    world = compute["pp"] * compute.get("dp_shard", 1)
    return load_trainer_args(run, world_size=world), world


def _second_step_report(args, world: int, rank: int) -> dict:
    """The old way: a whole first step (it builds the stages and sets the schedule up), then the
    second step measured."""
    microbatch = first_microbatch(args)
    with one_trace(), _engine(args, world, rank) as (engine, _):
        engine.train_step([microbatch], _loss_of(engine))
        assert engine.strategy.pipeline.built
        report = measure_step(engine, [microbatch], mesh_sizes(engine.strategy, world), rank)
    return dataclasses.asdict(report)


# 1F1B's first stage (rank 0), and interleaved 1F1B's rank 1 (stages 1 and 3: a middle and the last,
# with the loss); both under pipeline x FSDP (the per-rank numbers of a 70B plan, pp 8 x tp 8 x FSDP 8
# at 16 layers, ranks 0 and 448, compared the same way by hand, were equal too)
@pytest.mark.parametrize("schedule, rank", [("1f1b", 0), ("interleaved1f1b", 1)])
def test_the_measured_step_is_the_steady_one(schedule, rank):
    args, world = _args(schedule, {"pp": 2, "dp_shard": 2})
    row = dry_run(args, world, ranks=[rank], workers=1).to_dict()["ranks"][0]
    old = _second_step_report(args, world, rank)
    assert row == old, (schedule, row, old)
    if schedule == "1f1b":
        # the stages, traced in FSDP's bf16 (tests/test_pipeline_compute_dtype.py), send each of the 4
        # microbatches' 16 x 32 hidden states and receive their gradient in bf16 (16,384 B in fp32)
        assert row["collectives"]["p2p"] == {"pp": 4 * 2 * 16 * 32 * 2}
    assert sum(row["collectives"]["p2p"].values()) > 0  # the stages did send to each other


def test_ranks_measured_in_workers_report_what_one_process_reports(tmp_path, monkeypatch):
    # Side by side, rank 0 runs in this process up to the cut into stages (one trace, one cut, kept),
    # and each of the 3 ranks is then measured in a fresh fork over the kept cut. Every number equals
    # the ranks' measured one after another in this process (each cutting the model itself).
    args, world = _args("1f1b", {"pp": 2, "dp_shard": 2})
    ranks = [0, 1, 2]
    alone = dry_run(args, world, ranks=ranks, workers=1).to_dict()
    where = tmp_path / "pids"
    measure = dry_run_module.dry_run_rank
    made = []

    def logged(args, world_size, rank, microbatch):  # which process measured each rank, and how it cut
        out = measure(args, world_size, rank, microbatch)
        counts = one_trace_of_the_run[-1].counts
        with open(where, "a") as f:  # one write: the workers append to one file
            f.write(f"{rank} {os.getpid()} {counts['cut']} {counts['cut_shared']}\n")
        return out

    one_trace_of_the_run: list = []
    one_trace = dry_run_module.one_trace

    @contextlib.contextmanager
    def kept_one_trace():
        with one_trace() as traces:
            one_trace_of_the_run.append(traces)
            yield traces
            made.append(dict(traces.counts))

    monkeypatch.setattr(dry_run_module, "dry_run_rank", logged)
    monkeypatch.setattr(dry_run_module, "one_trace", kept_one_trace)
    forkable = rank_workers.forks_can_backward()
    forked = dry_run(args, world, ranks=ranks, workers=2).to_dict()
    rows = [tuple(map(int, line.split())) for line in where.read_text().splitlines()]
    pids = {rank: pid for rank, pid, *_ in rows}
    assert sorted(pids) == ranks
    # here: one trace and one cut (rank 0's, stopped there)
    assert made[0]["traced"] == 1 and made[0]["cut"] >= 1
    if forkable:
        assert os.getpid() not in pids.values() and len(set(pids.values())) == 3  # each in a fresh fork
        assert made == [{"traced": 1, "shared": 0, "cut": 1, "cut_shared": 0}]
        assert sorted((cut, taken) for _, _, cut, taken in rows) == [(1, 1)] * 3  # each took the kept cut
    else:  # torch 2.14, after this process's backwards on fake tensors (the tests before): measured here
        assert set(pids.values()) == {os.getpid()}
    assert [r["rank"] for r in forked["ranks"]] == ranks
    assert forked["ranks"] == alone["ranks"]
