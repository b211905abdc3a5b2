"""Evaluation and prediction under sharded strategies with an uneven eval set (real processes, gloo).

9 samples in batches of 4 over two data-parallel ranks: rank 0 reads 2 batches, rank 1 one. Every
forward of FSDP, tensor or pipeline parallelism is a collective, so the ranks must run the same
number of forwards: the short rank runs a padding forward whose outputs are discarded. The
metrics on EVERY rank must equal a one-process evaluation of the same weights, and
``predict(gather=True)`` must give rank 0 the one-process outputs in dataset order. One launch per
world size runs all of its cases (see workers/eval_even_worker.py); a rank stuck in a collective
fails on the short process-group timeout the worker sets, long before the test's own deadline.
"""

from __future__ import annotations

import json

import pytest

from distributed import WORKERS, check, fork_ranks, free_port

# not "fsdp": it is zero3 under another name (kiln.parallel.fsdp.FSDP, whose Zero3 changes only the name)
TWO_RANKS = ["ddp", "zero2", "zero3", "tp", "pp"]
FOUR_RANKS = ["hybrid_fsdp_tp", "hybrid_pp_fsdp"]
PG_TIMEOUT = 60  # seconds: far above a healthy collective's wait, far below the test's deadline


def _launch(tmp_path_factory, nproc, cases):
    out = tmp_path_factory.mktemp(f"eval_even{nproc}")
    port = free_port()
    env = lambda rank: {
        "RANK": rank,
        "WORLD_SIZE": nproc,
        "LOCAL_RANK": rank,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "KILN_TEST_PG_TIMEOUT": PG_TIMEOUT,
    }
    results = fork_ranks(WORKERS / "eval_even_worker.py", env, nproc=nproc, args=(str(out), *cases), timeout=400)
    ranks = []
    for rank in range(nproc):
        path = out / f"rank{rank}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else {})
    return results, ranks


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4, FOUR_RANKS)


def _check_case(launch, case):
    procs, ranks = launch
    done = [case in r for r in ranks]
    if not all(done):
        failed = next((p for p in procs if p.returncode != 0), procs[0])
        pytest.fail(
            f"{case}: ranks {[i for i, d in enumerate(done) if not d]} did not finish it (a rank left "
            f"waiting in a collective times out)\n{failed.stderr[-3000:]}"
        )
    for rank, results in enumerate(ranks):
        r = results[case]
        # every rank's metrics are those of one process on the same weights (float64 model)
        assert set(r["eval"]) == {"eval/loss", "eval/Accuracy"}, r["eval"]
        assert r["eval"]["eval/loss"] == pytest.approx(r["ref"]["eval/loss"], abs=1e-12), (case, rank)
        assert r["eval"]["eval/Accuracy"] == r["ref"]["eval/Accuracy"], (case, rank)
        # one sample: a data-parallel rank with an empty shard still joins every forward
        assert r["tiny"]["eval/loss"] == pytest.approx(r["tiny_ref"]["eval/loss"], abs=1e-12), (case, rank)
        assert r["tiny"]["eval/Accuracy"] == r["tiny_ref"]["eval/Accuracy"], (case, rank)
        if rank == 0:  # all outputs, in dataset order, batched as one process batches them
            assert not r["predict_none"]
            assert r["predict_shapes"] == [[4, 4], [4, 4], [1, 4]], case
            assert r["predict_diff"] < 1e-12, (case, r["predict_diff"])
    # a hook on the root module counts its forwards (a traced pipeline runs its stages instead: 0)
    counts = {results[case]["forwards"] for results in ranks}
    assert len(counts) == 1, f"{case}: forward calls differ between ranks: {counts}"


def _check_sharding(launch, case, dp_size):
    _, ranks = launch
    # the padding forwards are neither evaluation batches nor outputs
    batches = [r[case]["batches"] for r in ranks]
    shard = [r[case]["shard"] for r in ranks]
    if dp_size == 1:
        assert batches == [3] * len(ranks) and shard == [9] * len(ranks), (batches, shard)
    else:  # data-parallel rank d reads samples d, d + 2, ...: 5 and 4 samples
        assert sorted(set(batches)) == [1, 2] and sorted(set(shard)) == [4, 5], (batches, shard)
    assert [r[case]["predict_none"] for r in ranks[1:]] == [True] * (len(ranks) - 1)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", TWO_RANKS)
def test_eval_and_predict_two_ranks(two_ranks, case):
    _check_case(two_ranks, case)
    _check_sharding(two_ranks, case, 1 if case in ("tp", "pp") else 2)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["list", "generator"])
def test_eval_of_loaders_kiln_does_not_shard(two_ranks, kind):
    # each rank passes its own batches (2 and 1): with a len the count is agreed once, without one
    # batch by batch; the metrics are still the one-process ones on every rank
    _check_case(two_ranks, "zero3")
    for results in two_ranks[1]:
        r = results["zero3"]
        assert r[kind]["eval/loss"] == pytest.approx(r["ref"]["eval/loss"], abs=1e-12)
        assert r[kind]["eval/Accuracy"] == r["ref"]["eval/Accuracy"]


@pytest.mark.world_size(2)
def test_predict_gathers_drop_last_shards_in_dataset_order(two_ranks):
    # 9 samples, batch 4, drop_last: rank 0 keeps samples 0, 2, 4, 6, rank 1 keeps 1, 3, 5, 7
    _check_case(two_ranks, "ddp")
    diffs = two_ranks[1][0]["ddp"]["drop_last_diff"]
    assert len(diffs) == 2 and max(diffs) < 1e-12, diffs


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", FOUR_RANKS)
def test_eval_and_predict_hybrid_four_ranks(four_ranks, case):
    _check_case(four_ranks, case)
    _check_sharding(four_ranks, case, 2)


def test_launches_exit_cleanly(two_ranks):
    for proc in two_ranks[0]:
        check(proc)
