"""Context parallelism (kiln.parallel.context, Hybrid(cp=...), compute_config.cp) on CPU.

torch 2.13's ring attention has no CPU kernel, so these tests check what runs without it, with
one 2-rank gloo launch (workers/cp_worker.py) whose results the cases read:

* torch's load-balanced split of a batch inside ``ContextParallel.step`` (head-tail: rank r keeps
  chunks r and 2cp-1-r of 2cp), position ids and shift labels computed before the split, the
  batch as it was (keys and tensor objects) after the step, and ``context_parallel_unshard``
  giving the whole sequences back;
* ``Hybrid(cp=2)`` on a CPU device refused in one line;
* float64 SGD parity, 3 steps, through the Engine's ``train_step`` under ``Hybrid(cp=2)`` (FSDP
  over the cp ranks) with the attention replaced by a plain reference on gathered keys and values,
  against one process on whole sequences: losses, first-step gradients, weights within TOL.
  Measured: 1.3e-15 (losses), 8.3e-17 (gradients), 2.2e-16 (weights). The shards hold 14 and 8
  valid labels; the same run with each shard's own mean as its loss (no weighting by tokens:
  ``parity_unweighted``) is off by 4.6e-2 (losses), 5.2e-2 (gradients), 3.1e-2 (weights), and
  must fail the same check.

The dry run (no processes) runs Hybrid(cp=2) with the stand-in attention on keys and values
all-gathered over cp: the ring's bytes exactly, FSDP over dp_shard x cp, and rank 0's activations
against cp=1 (measured 0.64 x).

The CUDA path (torch's ring attention itself) is tested in tests/test_context_parallel_gpu.py.
"""

from __future__ import annotations

import json

import pytest

from distributed import WORKERS, check, fork_run
from kiln.config.compute import ComputeConfig
from kiln.parallel import Hybrid, ParallelDims
from kiln.parallel.context import check_context_parallel, prepare_batch

TOL = 1e-9
SEQ = 16


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp")
    check(fork_run(WORKERS / "cp_worker.py", str(out), nproc=2, timeout=300))
    return json.loads((out / "cp.json").read_text())


def _head_tail(rank, cp, seq):
    chunk = seq // (2 * cp)
    return [*range(rank * chunk, (rank + 1) * chunk), *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]


def test_batch_split_in_torchs_load_balanced_order(ranks):
    for rank, result in enumerate(ranks):
        inside = result["shard"]["inside"]
        order = _head_tail(rank, 2, SEQ)
        assert order == ([0, 1, 2, 3, 12, 13, 14, 15] if rank == 0 else [4, 5, 6, 7, 8, 9, 10, 11])
        tokens = [[row * SEQ + i for i in order] for row in range(2)]
        assert inside["input_ids"] == tokens
        assert inside["labels"] == tokens  # labels were the inputs' own object: cut once, not twice
        assert inside["position_ids"] == [order, order]
        # the label of position t is token t + 1, even where t + 1 sits on the other rank
        assert inside["shift_labels"] == [[t + 1 if t % SEQ != SEQ - 1 else -100 for t in row] for row in tokens]


def test_batch_restored_and_unsharded(ranks):
    whole = [list(range(SEQ)), list(range(SEQ, 2 * SEQ))]
    for result in ranks:
        shard = result["shard"]
        assert shard["after_keys"] == ["input_ids", "labels"]
        assert shard["after_same_objects"] is True
        assert shard["after_input_ids"] == whole
        assert shard["unshard_input_ids"] == whole
        assert shard["unshard_shift_labels"] == [row[1:] + [-100] for row in whole]


def test_cp_refused_on_cpu(ranks):
    for result in ranks:
        error = result["refused"]
        assert error is not None and "\n" not in error
        assert error.startswith("cp=2 needs CUDA devices, got cpu: ")
        assert "ring attention" in error and "set cp=1" in error


def test_loss_reduced_over_cp_equals_one_process(ranks):
    for result in ranks:
        parity = result["parity"]
        assert parity["mesh"] == ["cp"]
        assert parity["loss_abs"] < TOL, parity
        assert parity["grad_abs"] < TOL, parity
        assert parity["weight_abs"] < TOL, parity


def test_unweighted_shard_losses_fail_the_same_check(ranks):
    for result in ranks:
        broken = result["parity_unweighted"]
        assert broken["loss_abs"] > 1e-3 and broken["grad_abs"] > 1e-3 and broken["weight_abs"] > 1e-3, broken


# -- no processes ------------------------------------------------------------------------------
def test_check_context_parallel():
    check_context_parallel(1, "cpu")  # cp=1: nothing to refuse
    check_context_parallel(4, "cuda")
    with pytest.raises(ValueError, match=r"^cp=4 needs CUDA devices, got mps: "):
        check_context_parallel(4, "mps")


def test_mesh_has_cp_between_dp_shard_and_tp():
    dims = ParallelDims(dp_shard=-1, cp=2, tp=2).resolve(8)
    assert (dims.dp_shard, dims.cp, dims.tp, dims.dp) == (2, 2, 2, 2)
    assert dims.mesh_shape() == ((2, 2, 2), ("dp_shard", "cp", "tp"))
    with pytest.raises(ValueError, match=r"pp\*dp_replicate\*cp\*tp = 12 must divide 8"):
        ParallelDims(cp=3, tp=4).resolve(8)


def test_hybrid_cp_options_and_errors():
    assert repr(Hybrid(dp_shard=2, cp=4)) == "Hybrid(dp_replicate=1, dp_shard=2, tp=1, pp=1, cp=4)"
    assert Hybrid(cp=2).describe()["cp"] == 2
    with pytest.raises(ValueError, match=r"^Hybrid\(cp=2, ep=2\): context parallelism is not combined with expert"):
        Hybrid(cp=2, ep=2)
    with pytest.raises(ValueError, match=r"^Hybrid\(cp=2, pp=2\): context parallelism is not combined with pipeline"):
        Hybrid(cp=2, pp=2, split_points=["layers.1"])


def test_compute_config_cp_selects_hybrid_and_shares_batches():
    cc = ComputeConfig(cp=2)
    assert cc.strategy_name("autodist", 4) == "hybrid"
    assert cc.mesh_size == 2  # the 2 cp ranks read one batch: 4 ranks are 2 data-parallel ones
    assert ComputeConfig(cp=2, tp=2).mesh_size == 4


def test_prepare_batch_needs_dict_of_input_ids():
    with pytest.raises(TypeError, match=r"takes dict batches with 'input_ids'.*got Tensor"):
        import torch

        prepare_batch(torch.zeros(2, 8))
    with pytest.raises(TypeError, match=r"got a dict with keys \['x'\]"):
        prepare_batch({"x": 1})


# -- the dry run (kiln plan --dry-run): fake tensors, no processes --------------------------------
def _dry_run(cp: int):
    import sys

    from distributed import ROOT
    from kiln.config.args import load_trainer_args
    from kiln.planning.dry_run import dry_run

    sys.path.insert(0, str(ROOT / "examples"))  # lm_data
    model = {"vocab_size": 64, "dim": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "max_seq_len": 64}
    config = {
        "compute_config": {"cp": cp, "dp_shard": -1},
        "micro_batch_size": 2,
        "max_train_steps": 1,
        "model": {"type": "kiln.models.MoELlama", "args": {**model, "num_dense_layers": 2}},
        "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
        "dataset": {"type": "lm_data.StdlibText.from_stdlib", "train_args": {"seq_len": 64, "max_bytes": 20000}},
    }
    return dry_run(load_trainer_args(config, world_size=4), 4).ranks[0]


def test_dry_run_counts_the_ring_and_splits_the_activations():
    with_cp, without = _dry_run(2), _dry_run(1)
    assert with_cp.coordinates == {"dp_shard": 0, "cp": 0}
    # keys and values of each of the 2 layers, all-gathered over cp forward and reduce-scattered
    # backward: (batch 2, 4 heads after the GQA repeat, 64 tokens, head dim 8) float32 = 16 KiB,
    # the whole sequence's (what the counter counts), plus the positions (2 x 64 int64) once
    kv = 2 * 4 * 64 * 8 * 4
    assert with_cp.collectives["all_gather"]["cp"] == 2 * 2 * kv + 2 * 64 * 8
    assert with_cp.calls["all_gather"]["cp"] == 5
    assert with_cp.collectives["reduce_scatter"]["cp"] == 2 * 2 * kv
    assert with_cp.collectives["all_reduce"]["cp"] == 8 + 4  # the token count (float64), the loss sum
    assert "dp_shard+cp" in with_cp.collectives["reduce_scatter"]  # FSDP over dp_shard x cp
    assert with_cp.params == without.params  # 4 ranks shard the weights either way
    # each rank's share of the sequence: measured 0.64 x (the gathered keys and values stay
    # whole); whole sequences on every rank would be 1.0 x or more, and a count that lost half of
    # what a rank holds (0.32 x) is as wrong: bounded on both sides
    ratio = with_cp.activations / without.activations
    assert 0.55 < ratio < 0.75, (with_cp.activations, without.activations)


def test_kiln_train_refuses_cp_on_cpu_before_any_process(tmp_path, monkeypatch, capsys):
    import torch

    from distributed import ROOT
    from kiln.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # the run file's dataset is examples.lm_data
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    overrides = ["--compute_config.ep", "1", "--compute_config.cp", "2", "--nproc-per-node", "2"]
    assert main(["train", "-f", str(ROOT / "examples" / "moe_pretrain.yaml"), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kiln train: error: compute_config.cp: cp=2 needs CUDA devices, got cpu: "), err
    assert "\n" not in err
    assert list(tmp_path.iterdir()) == []  # nothing written, no process started
