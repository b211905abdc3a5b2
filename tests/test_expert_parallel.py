"""Expert parallelism (kiln.parallel.transforms.expert_parallel, Hybrid(ep=...), compute_config.ep) against one process.

Parity (workers/moe_parity_worker.py): a tiny kiln.models.MoELlama in float64 trained with plain
SGD for 2 steps, each rank on its data-parallel share, against a plain torch loop on the whole
batch in one process: every step's loss (aux loss included), the first step's full gradients and
every weight and buffer after 2 steps within TOL = 1e-9. Cases: EP 2 on 2 ranks (efsdp 1); on 4
ranks EP 2 x FSDP 2 (the experts FSDP-sharded over the 2 ranks holding the same experts), EP 2 x TP
2 and EP 2 x HSDP (dp_replicate 2). Variants: softmax routing with the aux loss; DeepSeek-V3's
sigmoid routing with a shared expert and bias balancing (the bias update's all-reduce); clipping
at 0.05, under every step's norm (the global norm over DTensors on the experts' and the blocks' meshes),
under EP 2 x FSDP 2, where the experts' mesh has both dimensions (EP 2 alone clipped the same way
over one: the case ep2:clip, dropped).

Margin, measured (torch 2.13, CPU, gloo): at most 1.8e-15 in losses, 5.6e-17 in gradients and
2.2e-16 in weights. The worker also runs EP 2 with ExpertParallel.combine returning twice the
experts' outputs (a 2x error in the combine weights): losses off by 1.5e-2, gradients by 9.9e-3,
weights by 7.1e-3, and the test asserts that it fails the same check.

Checked by breaking the code on purpose: without the experts' 1/ep gradient scale, EP 2 fails
(expert gradients twice the one-process ones: off by 8.2e-3, weights by 7.1e-3); with FSDP's
set_gradient_divide_factor(dp) instead of that scale, EP 2 on 2 ranks fails (torch 2.13 divides
twice when the reduce-scatter group has one rank and the gradients are float64: half the expert
gradients, off by 4.1e-3).

Resharding (workers/moe_reshard_worker.py): the Trainer saves a sharded checkpoint under EP 2 on
2 ranks (AdamW, 2 batches); loaded on 1 process (single) and on 4 ranks (EP 4), weights and AdamW
state equal the saved ones exactly, and one more batch on each gives the same weights within TOL.
The save and the EP 4 load run at the end of the 2-rank and 4-rank parity launches, the load on one
process in a rank forked from the warm server (a fresh interpreter cost 7.5 CPU-s).
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from distributed import ROOT, WORKERS, check, fork_run
from kiln.config.args import load_trainer_args
from kiln.config.overrides import ConfigError
from kiln.parallel import Hybrid, ParallelDims
from kiln.parallel.transforms.expert_parallel import check_expert_parallel

TOL = 1e-9
# (ep2:clip, clipping over the experts' ep mesh alone, is left to ep2_fsdp2:clip, over efsdp x ep)
TWO_RANKS = ["ep2:plain", "ep2:bias", "ep2_broken_combine:plain"]
FOUR_RANKS = ["ep2_fsdp2:plain", "ep2_fsdp2:clip", "ep2_tp2:plain", "ep2_hsdp:plain"]


OUTPUT: dict[int, str] = {}  # each launch's stdout and stderr, by its number of ranks


def _launch(tmp_path_factory, nproc, cases, reshard):
    out = tmp_path_factory.mktemp(f"moe_parity{nproc}")
    result = check(
        fork_run(WORKERS / "moe_parity_worker.py", str(out), *cases, "--reshard", *reshard, nproc=nproc, timeout=300)
    )
    OUTPUT[nproc] = result.stdout + result.stderr
    return json.loads((out / "moe_parity.json").read_text())


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    """The resharding test's folder: the 2-rank launch saves its checkpoint there, the 4-rank one loads it."""
    return tmp_path_factory.mktemp("moe_reshard")


# The resharding test's EP 2 save and EP 4 load run in the parity launches of the same sizes (after
# their cases, in the same process group): two launches where there were four.
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, reshard):
    return _launch(tmp_path_factory, 2, TWO_RANKS, [str(reshard), "save", "2"])


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory, reshard, two_ranks):
    return _launch(tmp_path_factory, 4, FOUR_RANKS, [str(reshard), "load", "4"])


def _failures(r):
    found = []
    if r["loss_abs"] >= TOL:
        found.append(f"losses differ by {r['loss_abs']:.3g}")
    for key, what in (("grad", "first-step gradients"), ("weight", "weights after 2 steps")):
        if r[f"{key}_missing"]:
            found.append(f"{what} lack {r[f'{key}_missing']}")
        if r[f"{key}_abs"] >= TOL or r[f"{key}_rel"] >= TOL:
            found.append(f"{what} differ by {r[f'{key}_abs']:.3g} ({r[f'{key}_rel']:.3g} relative)")
    return found


def _check(results, case):
    r = results[case]
    assert not _failures(r), f"{case}: {'; '.join(_failures(r))}"
    if "clip" in r:  # every step clipped
        assert min(r["ref_norms"]) > 2 * r["clip"], r["ref_norms"]
    if "bias_abs" in r:  # the balancing moved the bias, so the parity covers its update
        assert r["bias_abs"] > 1e-3


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", [c for c in TWO_RANKS if "broken" not in c])
def test_expert_parallel_equals_one_process_two_ranks(two_ranks, case):
    _check(two_ranks, case)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", FOUR_RANKS)
def test_expert_parallel_equals_one_process_four_ranks(four_ranks, case):
    _check(four_ranks, case)


@pytest.mark.world_size(2)
@pytest.mark.world_size(4)
def test_clipping_over_the_experts_two_mesh_dimensions_warns_nothing(four_ranks):
    # ep2_fsdp2:clip clips gradients split over efsdp x ep: the norm is combined over each dimension
    # in turn without DTensor's "While redistributing ... 2 sequential all_reduce operations" warning
    # on every rank (the parity test above checks the norm itself)
    assert "ep2_fsdp2:clip" in four_ranks
    assert "sequential all_reduce" not in OUTPUT[4], OUTPUT[4][-2000:]


def test_a_doubled_combine_fails_the_parity_check(two_ranks):
    r = two_ranks["ep2_broken_combine:plain"]
    failures = _failures(r)
    assert len(failures) == 3, failures  # losses, gradients and weights all off
    assert r["loss_abs"] > 1e6 * TOL and r["grad_abs"] > 1e6 * TOL and r["weight_abs"] > 1e6 * TOL, r


@pytest.mark.world_size(4)
def test_checkpoints_load_across_expert_parallel_sizes(reshard, four_ranks):
    # saved under EP 2 and loaded under EP 4 by the parity launches; on one process here (a world
    # of 1: the strategy is single), forked from the warm server
    check(fork_run(WORKERS / "moe_reshard_worker.py", str(reshard), "load", "1", nproc=1, timeout=300))
    for world in (1, 4):
        report = json.loads((reshard / f"loaded_{world}.json").read_text())
        assert report["batch"] == 2, report
        for key in ("weights", "optimizer"):
            assert not report[f"{key}_missing"] and not report[f"{key}_extra"], report
            assert report[f"{key}_abs"] == 0.0, (world, key, report[f"{key}_abs"])
        assert report["weights_count"] == 23 and report["optimizer_count"] == 3 * 23  # step, exp_avg, exp_avg_sq
        assert len(report["expert_keys"]) == 6  # 2 layers x w1, w2, w3, each whole (num_experts, ...)
    one, four = (torch.load(reshard / f"final_{w}.pt", weights_only=True) for w in (1, 4))
    saved = torch.load(reshard / "saved.pt", weights_only=True)["weights"]
    assert max((one[k] - four[k]).abs().max().item() for k in one) < TOL
    assert max((one[k] - saved[k]).abs().max().item() for k in one) > 1e6 * TOL  # the extra step moved them


# -- sizes and errors, before any process group ------------------------------------------------------
def test_ep_must_divide_dp_shard():
    assert ParallelDims(dp_shard=-1, tp=2, ep=2).resolve(8).dp_shard == 4
    with pytest.raises(ValueError) as err:
        ParallelDims(dp_shard=-1, ep=4).resolve(6)
    assert str(err.value) == (
        "parallel dimension ep=4 must divide dp_shard=6 (pp=1, dp_replicate=1, dp_shard=6, tp=1, ep=4): expert "
        "parallelism takes its ranks from dp_shard; use an ep in [1, 2, 3, 6], or a dp_shard that is a multiple of 4"
    )
    with pytest.raises(ValueError, match=r"^parallel dimension ep=0 must be an integer >= 1$"):
        ParallelDims(ep=0)


def _moe_model(num_experts=4):
    import kiln

    return kiln.models.MoELlama(vocab_size=16, dim=16, num_layers=1, num_heads=2, num_experts=num_experts, top_k=2)


def test_ep_must_divide_every_layers_experts_and_needs_moe_layers():
    check_expert_parallel(_moe_model(4), 4)
    with pytest.raises(ValueError) as err:
        check_expert_parallel(_moe_model(6), 4)
    assert str(err.value) == (
        "ep=4 does not divide num_experts=6 of MoE layer 'layers.0.feed_forward' (each rank holds num_experts / ep "
        "whole experts); use an ep in [1, 2, 3, 6]"
    )
    with pytest.raises(ValueError, match=r"^ep=2 splits the experts of kiln.models.MoE layers over ranks, and Linear"):
        check_expert_parallel(torch.nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match=r"^Hybrid\(ep=2, pp=2\): expert parallelism does not run inside pipeline"):
        Hybrid(ep=2, pp=2, split_points=["layers.0"])


def _args(**compute):
    return {
        "compute_config": compute,
        "model": {"type": "kiln.models.MoELlama", "args": {"num_experts": 4}},
        "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
        "dataset": {"type": "torch.utils.data.TensorDataset"},
        "max_train_steps": 1,
    }


def test_compute_config_ep_selects_hybrid_with_ep():
    from kiln.config.trainer_builder import _strategy

    args = load_trainer_args(_args(ep=2), world_size=4).resolve(4)
    assert args.compute_config.strategy_name(args.pas_policy, 4) == "hybrid"
    strategy = _strategy(args, types.SimpleNamespace(world_size=4))
    assert isinstance(strategy, Hybrid) and strategy.dims == ParallelDims(dp_shard=-1, ep=2)


def test_compute_config_ep_that_does_not_divide_dp_shard_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        load_trainer_args(_args(ep=4, tp=2), world_size=4).resolve(4)
    assert str(err.value) == (
        "compute_config.ep: got 4 (int), expected a divisor of dp_shard = 2 in a world of 4 (expert parallelism takes "
        "its ranks from dp_shard)"
    )


# -- the dry run (kiln plan --dry-run) counts the experts' shards and the all-to-all bytes ------------
def test_dry_run_counts_expert_shards_and_all_to_all_bytes(monkeypatch):
    from kiln.planning.dry_run import dry_run

    monkeypatch.syspath_prepend(str(ROOT))  # the run file's dataset is examples.lm_data
    small = {"dim": 32, "moe_hidden_dim": 64, "max_seq_len": 16}
    overrides = [f"--model.args.{k}={v}" for k, v in small.items()]
    overrides += ["--micro_batch_size=2", "--activation_checkpointing=None"]
    for split in ("train_args", "val_args"):
        overrides += [f"--dataset.{split}.seq_len=16", f"--dataset.{split}.max_bytes=20000"]
    args = load_trainer_args(ROOT / "examples" / "moe_pretrain.yaml", overrides, world_size=4)
    report = dry_run(args, 4)
    rank = report.ranks[0]
    # per MoE layer (3): the counts (8 experts, int64), then 2 x 16 tokens x top-2 = 64 rows of 32
    # floats sent to the experts and back, forward and backward (balanced routing under fake tensors)
    rows_bytes = 2 * 16 * 2 * 32 * 4
    assert rank.collectives["all_to_all"] == {"dp_shard": 3 * (8 * 8 + 4 * rows_bytes)}
    assert rank.calls["all_to_all"] == {"dp_shard": 3 * 5}
    # the experts split 4 ways (ep 2 x efsdp 2); every other weight FSDP-sharded over dp_shard 4
    # (rank 0 holds the first, padded, shard of each)
    import kiln

    torch.manual_seed(0)
    model = kiln.models.MoELlama(**{**args.model.args, **small})
    want = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            want += p.numel() // 4 * 4
        else:
            want += -(-p.shape[0] // 4) * (p.numel() // p.shape[0]) * 4
    assert rank.params == want
