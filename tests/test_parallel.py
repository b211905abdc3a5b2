"""Parallel strategies with real processes (CPU, gloo): parity with one process, checkpoints, auto.

One launch per world size trains every strategy (see workers/parallel_worker.py); the tests below
read its results. The run: AdamW with a StepLR built on the user's optimizer, global batch 16,
4 steps, float64 so that only logic errors (not reduction order) can exceed the 1e-5 tolerance.

What AdamW adds to test_parallel_sgd.py, which checks every strategy's gradients, accumulation and
clipping under SGD to 1e-10: optimizer state (sharded by ZeRO and FSDP) and a scheduler. So each
strategy runs the plain variant here, and accumulation with clipping (one run, "accum2_clip":
the scheduler stepping once per accumulation cycle, the clipped norm the global one) under a
sharded optimizer (zero1), a pipeline (pp_interleaved) and the hybrids that shard or replicate
the data (hybrid_hsdp, hybrid_pp_fsdp).
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from distributed import WORKERS, check, fork_run

sys.path.insert(0, str(WORKERS))  # the shared test model lives beside the workers

TOL = 1e-5
TWO_RANKS = [
    "ddp:plain",
    "zero1:plain,accum2_clip",
    "zero2:plain",
    "zero3:plain",
    "tp:plain",
    "pp_1f1b:plain",
    "pp_gpipe:plain",
    "pp_interleaved:plain,accum2_clip",
    "zero3_offload:plain",
    "zero3_amp_bf16:plain",
    "auto_big:plain",
    "auto_small:plain",
]
FOUR_RANKS = [
    "hybrid_fsdp_tp:plain",
    "hybrid_hsdp:accum2_clip",
    "hybrid_pp_fsdp:accum2_clip",
    "hybrid_pp_tp:plain",
]


def _launch(tmp_path_factory, nproc, cases):
    out = tmp_path_factory.mktemp(f"parallel{nproc}")
    check(fork_run(WORKERS / "parallel_worker.py", str(out), *cases, nproc=nproc, timeout=400))
    return out, json.loads((out / "parity.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4, FOUR_RANKS)


def _check_case(results, case):
    variants = {k: v for k, v in results[case].items() if isinstance(v, dict) and "max_diff" in v}
    assert variants, f"{case} ran no variant"
    for variant, r in variants.items():
        assert not r["missing"], f"{case}/{variant}: full state dict lacks {r['missing']}"
        assert r["max_diff"] < TOL, f"{case}/{variant}: weights differ from one process by {r['max_diff']:.3g}"
        if "clip" in variant:  # the clipped norm is the global one, not a shard's
            assert r["norm"] == pytest.approx(r["ref_norm"], rel=1e-9), (
                f"{case}: grad norm {r['norm']} != {r['ref_norm']}"
            )
    if "eval_diff" in results[case]:
        assert results[case]["eval_diff"] < 1e-9, f"{case}: eval-mode forward differs"


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "case", ["ddp", "zero1", "zero2", "zero3", "zero3_offload", "tp", "pp_1f1b", "pp_gpipe", "pp_interleaved"]
)
def test_parity_two_ranks(two_ranks, case):
    _check_case(two_ranks[1], case)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", ["hybrid_fsdp_tp", "hybrid_hsdp", "hybrid_pp_fsdp", "hybrid_pp_tp"])
def test_parity_hybrid_four_ranks(four_ranks, case):
    _check_case(four_ranks[1], case)


@pytest.mark.world_size(2)
def test_auto_picks_ddp_when_it_fits_and_zero3_when_only_it_fits(two_ranks):
    results = two_ranks[1]
    assert results["auto_big"]["chosen"] == "ddp", results["auto_big"]["reason"]
    assert results["auto_small"]["chosen"] == "zero3", results["auto_small"]["reason"]
    assert "ddp, zero1, zero2 would not" in results["auto_small"]["reason"]
    _check_case(results, "auto_big")
    _check_case(results, "auto_small")


@pytest.mark.world_size(2)
def test_zero3_checkpoint_loads_under_ddp_on_two_ranks(two_ranks):
    ckpt = two_ranks[1]["zero3"]["checkpoint"]
    assert ckpt["weights_diff"] == 0.0
    assert ckpt["adam_steps"] == [4.0]
    assert ckpt["lr"] == pytest.approx(1e-2 * 0.7**4)  # the scheduler's rate came back too


@pytest.mark.world_size(2)
def test_zero3_checkpoint_loads_on_one_rank(two_ranks):
    from parallel_model import check_loads_on_one_process

    check_loads_on_one_process(two_ranks[0], "zero3")


@pytest.mark.world_size(2)
def test_fsdp_mixed_precision_trains_close_to_fp32(two_ranks):
    # amp_bf16: FSDP gathers bf16 parameters and reduces in fp32; only bf16 rounding separates it
    r = two_ranks[1]["zero3_amp_bf16"]["plain"]
    assert r["max_diff"] < 0.05 and math.isfinite(r["loss"]), r


@pytest.mark.parametrize("case,world", [("zero1", 2), ("pp_1f1b", 2), ("hybrid_fsdp_tp", 4)])
def test_dcp_state_round_trip_then_one_more_step_matches(two_ranks, four_ranks, case, world):
    # saved with kiln.parallel.state.dcp_state, loaded into a fresh engine before its first step (a
    # pipeline not yet traced, a ZeRO-1 optimizer with its shard), then both take a step
    results = (two_ranks if world == 2 else four_ranks)[1]
    assert results[case]["roundtrip_diff"] == 0.0
