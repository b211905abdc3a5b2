"""Zero-bubble pipeline schedules (Pipeline/Hybrid schedule="zbv" | "dualpipev" | "interleaved_zb")
against one process, and a pipeline under FSDP and amp_bf16 (the bug of issue 26).

Parity (workers/zero_bubble_worker.py): a residual MLP in float64 with two blocks per pipeline rank,
cut before every block but the first, trained with plain SGD for 2 steps against a plain torch loop
on the whole batch in one process: every step's loss, the first step's gradients (before clipping),
the gradient the first step applied (after clipping), the weights after 2 steps and every step's
clipped norm, each within TOL = 1e-9; and the eval-mode forward of every rank after the first step
(the forward-only order), after which training goes on. On 2 ranks zbv plain and with both
accumulation over 2 micro-steps and clipping at 0.05 (under every step's norm) at once, dualpipev
and interleaved_zb with both at once (the first-step gradients, read before clipping, and the norms
see the accumulation's scale, the applied gradient the clipping's); on 4 ranks zbv and dualpipev over 8 stages, and zbv with FSDP
over 2 x 2 ranks, with both at once.

Margin, measured (torch 2.13, CPU, gloo): at most 6.7e-16 in losses, 1.4e-16 in gradients, 3.3e-16
in weights and 6.1e-16 in eval outputs. A gradient twice too large is off by 0.27 and moves the
weights by 0.24 after 3 steps (6.1e-3 under clipping): the worker's "scale2", checked to stay large.
(Measured with 3 steps; 2 now, the second on the first's weights: a third proved nothing more, at a
third more of every case's training. The data is still drawn for 3 steps: the amp_bf16 case's first
batch is the one where bf16 visibly moves the loss from float32's.)

Checked by breaking the code on purpose: the per-microbatch loss scale doubled fails every 2-rank
case (gradients off by 0.27); the V's last stage placed by the loop rule (its loss and outputs
broadcast from the wrong rank) and the eval run on the whole training order each fail the 2-rank
launch; FSDP resharding after forward under zbv fails zbv_fsdp (the last stage's gradients
missing); without the cast of stage outputs to their traced dtypes the amp_bf16 case fails (losses
not finite).

amp_bf16 x FSDP x pp (1f1b on 2 x 2 ranks) against one process under torch.autocast: bf16 rounding
moves the numbers by about 1e-3, so the losses and weights must stay within 5e-3 (the bug gave 1e21
and nan), and the first step's loss, before any update, within 1e-5 of the autocast run: measured
1.2e-7, where a run without autocast would be 7.3e-4 away.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml

from distributed import ROOT, WORKERS, check, fork_run
from kiln.cli.main import main
from kiln.config.args import load_trainer_args
from kiln.config.overrides import ConfigError
from kiln.parallel import Hybrid, Pipeline
from kiln.parallel.pipelining.schedules import stage_count_error, stage_ids, stage_rank

TOL = 1e-9
TWO_RANKS = {"zbv": ("plain", "accum2_clip"), "dualpipev": ("accum2_clip",), "interleaved_zb": ("accum2_clip",)}
FOUR_RANKS = {"zbv_4": ("accum2_clip",), "dualpipev_4": ("accum2_clip",), "zbv_fsdp": ("accum2_clip",)}
AMP = "amp_bf16_fsdp"


def _launch(tmp_path_factory, nproc, cases):
    out = tmp_path_factory.mktemp(f"zero_bubble{nproc}")
    check(fork_run(WORKERS / "zero_bubble_worker.py", str(out), *cases, nproc=nproc, timeout=300))
    return json.loads((out / "zero_bubble.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2, list(TWO_RANKS))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4, [*FOUR_RANKS, AMP])


def _check(results, case, variant):
    r = results[case][variant]
    for key, what in (
        ("grad", "first-step gradients"),
        ("update", "first-step applied gradients"),
        ("weight", f"weights after {results['steps']} steps"),
    ):
        assert not r[f"{key}_missing"], f"{case}/{variant}: {what} lack {r[f'{key}_missing']}"
        assert r[f"{key}_abs"] < TOL, f"{case}/{variant}: {what} differ from one process by {r[f'{key}_abs']:.3g}"
    assert r["loss_abs"] < TOL, f"{case}/{variant}: losses {r['losses']} vs one process {r['ref_losses']}"
    assert len(r["eval_abs"]) >= 2 and max(r["eval_abs"]) < TOL, f"{case}/{variant}: eval outputs {r['eval_abs']}"
    if "clip" in variant:  # the clipped norm is the global one, every step, and every step clips
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=TOL, abs=0), f"{case}: grad norms differ"
        assert min(r["ref_norms"]) > 2 * results["clip"]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case,variant", [(c, v) for c, vs in TWO_RANKS.items() for v in vs])
def test_zero_bubble_parity_two_ranks(two_ranks, case, variant):
    _check(two_ranks, case, variant)


@pytest.mark.world_size(2)
def test_a_scale_error_would_exceed_the_tolerance(two_ranks):
    for variant, s in two_ranks["scale2"].items():
        assert s["grad_abs"] > 1e6 * TOL and s["weight_abs"] > 1e6 * TOL, (variant, s)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case,variant", [(c, v) for c, vs in FOUR_RANKS.items() for v in vs])
def test_zero_bubble_parity_four_ranks(four_ranks, case, variant):
    _check(four_ranks, case, variant)


@pytest.mark.world_size(4)
def test_pipeline_with_fsdp_under_amp_bf16_trains_like_autocast(four_ranks):
    amp, fp32 = four_ranks[AMP]["amp"], four_ranks[AMP]["fp32"]
    losses, ref = amp["losses"], amp["ref_losses"]
    assert all(math.isfinite(x) for x in losses), losses
    assert amp["loss_abs"] < 5e-3, f"losses {losses} vs one process under autocast {ref}"
    assert amp["weight_abs"] < 5e-3 and amp["grad_abs"] < 5e-3, amp
    assert max(amp["eval_abs"]) < 2e-2, amp["eval_abs"]
    # the stages send activations and receive their gradients in FSDP's bf16 (a float32 trace sent
    # float32: twice the bytes, and float32 gradients inside each stage)
    assert four_ranks[AMP]["p2p_dtypes"] == ["torch.bfloat16"], four_ranks[AMP]["p2p_dtypes"]
    # the stages really computed in bfloat16: the first loss is the autocast one, not float32's
    assert abs(losses[0] - ref[0]) < 1e-5, (losses[0], ref[0])
    assert abs(losses[0] - fp32["ref_losses"][0]) > 1e-4, (losses[0], fp32["ref_losses"][0])


# -- layouts and refusals (no processes) ---------------------------------------------------------
def test_v_layout_puts_stages_r_and_2pp_minus_1_minus_r_on_rank_r():
    assert [stage_ids("zbv", 8, r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [stage_rank("dualpipev", s, 8, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_ids("interleaved_zb", 8, r, 4) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_rank("interleaved_zb", s, 8, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize(
    "schedule,stages,pp,microbatches,message",
    [
        ("zbv", 6, 2, None, r"'zbv'\) runs exactly 2 stages per rank in a V .* 5 split points make 6 stages .*give 3"),
        ("dualpipev", 2, 2, None, r"runs exactly 2 stages per rank .*give 3 split points"),
        ("dualpipev", 4, 2, 3, r"at least as many microbatches as its 4 stages, but got microbatches=3; give .*=4"),
        ("zbv", 8, 4, 6, r"2 \* 4 - 1 = 7 microbatches .* got microbatches=6; give microbatches=7"),
        ("interleaved_zb", 6, 4, None, r"at least 2 stages per rank and a multiple of the 4 .* give 7 split points"),
        ("interleaved_zb", 4, 2, 5, r"microbatches must be a multiple of 2 .* got microbatches=5; give microbatches=4"),
    ],
)
def test_schedule_constraints_are_refused_in_one_line(schedule, stages, pp, microbatches, message):
    error = stage_count_error(stages, pp, schedule, microbatches)
    assert error is not None and "\n" not in error
    assert re.search(message, error), error


def test_constraints_met():
    assert stage_count_error(4, 2, "zbv", 3) is None  # 2 * 2 - 1
    assert stage_count_error(8, 4, "dualpipev", None) is None  # the default: one microbatch per stage
    assert stage_count_error(6, 2, "interleaved_zb", 4) is None


def test_strategies_take_the_new_names():
    for schedule in ("zbv", "dualpipev", "interleaved_zb"):
        assert Pipeline(["a", "b", "c"], schedule=schedule.upper()).schedule == schedule
        assert Hybrid(pp=2, split_points=["a", "b", "c"], schedule=schedule).schedule == schedule
    with pytest.raises(ValueError, match="schedule='zb' is not known; expected one of .*zbv, dualpipev"):
        Pipeline(["a"], schedule="zb")


RUN = {
    "model": {"type": "examples.mlp_model.MLP", "args": {"dim": 4, "nlayers": 4}},
    "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
    "dataset": {"type": "examples.mlp_model.RandomDataset", "train_args": {"dim": 4, "size": 16}},
    "micro_batch_size": 4,
    "max_train_steps": 1,
}


def _run(schedule, **options):
    options = {"split_points": ["layers.1", "layers.2", "layers.3"], "schedule": schedule, **options}
    return {**RUN, "compute_config": {"strategy": "pp", "strategy_options": options}}


def test_yaml_schedule_key(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # examples.mlp_model
    args = load_trainer_args(_run("zbv"), world_size=2)
    assert args.compute_config.strategy_options["schedule"] == "zbv"
    with pytest.raises(ConfigError, match=r"strategy_options.schedule: got 'zvb' .*\(did you mean 'zbv'\?\)"):
        load_trainer_args(_run("zvb"), world_size=2)
    with pytest.raises(ConfigError, match=r"strategy_options: Pipeline\(schedule='dualpipev'\) needs at least"):
        load_trainer_args(_run("dualpipev", microbatches=2), world_size=2)
    hybrid = _run("zbv")
    hybrid["compute_config"] = {
        "pp": 2,
        "dp_shard": 2,
        "strategy_options": hybrid["compute_config"]["strategy_options"],
    }
    assert load_trainer_args(hybrid, world_size=4).compute_config.pp == 2
    hybrid["compute_config"]["strategy_options"]["split_points"] = ["layers.1"]
    with pytest.raises(ConfigError, match=r"runs exactly 2 stages per rank in a V .* give 3 split points"):
        load_trainer_args(hybrid, world_size=4)


def test_cli_refuses_a_schedule_with_exit_2_and_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_run("dualpipev", microbatches=2)))
    assert main(["train", "-f", "run.yaml", "--nproc-per-node", "2"]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln train: error: compute_config.strategy_options: "), err
    assert "microbatches=2; give microbatches=4 or more" in lines[0] and not out
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]
