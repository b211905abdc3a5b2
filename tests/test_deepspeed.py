"""The deepspeed strategy with real processes (CPU, gloo): DeepSpeed's engine runs backward and the
optimizer step for kiln's Engine and Trainer.

DeepSpeed reduces float32 at most, and in float32 Adam turns summation-order noise in tiny
gradients into ~1e-4 differences from a one-process run (kiln's ddp shows the same). So these runs
compare DeepSpeed against kiln's ddp on the same two ranks and accumulation, which float64 parity
(tests/test_parallel.py) ties to one process: both sum the same per-rank parts, so they agree to
float32 rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch
from torch import nn

from distributed import WORKERS, check, fork_run

if importlib.util.find_spec("deepspeed") is None:
    if "deepspeed" in os.environ.get("KILN_TEST_REQUIRE", "").split(","):
        raise ImportError("KILN_TEST_REQUIRE names deepspeed but it is not installed: run `make install`")
    pytest.skip(
        "deepspeed is not installed (the Makefile installs it; `make test` runs these)", allow_module_level=True
    )
sys.path.insert(0, str(WORKERS))

STAGES = [f"deepspeed_zero{stage}" for stage in range(4)]
# plain, and accumulation with clipping in one run: the clipped norm, taken before clipping, would
# see a lost 1/accumulation; the weights the clip coefficient
VARIANTS = ("plain", "accum2_clip")


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    check(
        fork_run(
            WORKERS / "parallel_worker.py",
            str(out),
            *(f"{stage}:{','.join(VARIANTS)}" for stage in STAGES),
            timeout=400,
            env={"KILN_PARITY_DTYPE": "float32"},
        )
    )
    return out, json.loads((out / "parity.json").read_text())


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", STAGES)
def test_each_zero_stage_matches_ddp_with_accumulation_and_clipping(parity, case):
    results = parity[1][case]
    for variant in VARIANTS:
        r = results[variant]
        assert not r["missing"], f"{case}/{variant}: full state dict lacks {r['missing']}"
        assert r["max_diff"] < 1e-6, f"{case}/{variant}: weights differ from ddp by {r['max_diff']:.3g}"
    clip = results["accum2_clip"]
    assert clip["norm"] == pytest.approx(clip["ref_norm"], rel=1e-6), "the clipped norm is the global one"
    assert results["plain"]["norm"] is None  # no clipping asked for: DeepSpeed's default 1.0 is not applied
    assert results["eval_diff"] < 1e-6
    # saved through the strategy, loaded into a fresh DeepSpeed engine, one more step on both
    assert results["roundtrip_diff"] == 0.0


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_checkpoint_loads_under_ddp(parity, case):
    ckpt = parity[1][case]["checkpoint"]
    assert ckpt["weights_diff"] == 0.0
    assert ckpt["adam_steps"] == [4.0]
    assert ckpt["lr"] == pytest.approx(1e-2 * 0.7**4)  # the scheduler's rate, kept in the groups


@pytest.mark.world_size(2)
def test_deepspeed_checkpoint_loads_on_one_rank_without_deepspeed(parity):
    from parallel_model import check_loads_on_one_process

    check_loads_on_one_process(parity[0], "deepspeed_zero3")


@pytest.mark.world_size(2)
def test_trainer_under_deepspeed_killed_and_autoresumed_is_bit_exact(tmp_path):
    # ckpt_trainer: dropout, shuffling, AdamW, warmup + cosine, grad_accum=2, amp_bf16, MixUp
    run, crash = tmp_path / "run", tmp_path / "crash"
    # saving every 8 batches (not 4) halves the checkpoints written; the last before the crash is
    # still mid-epoch
    args = ("--strategy", "deepspeed", "--interval", "8ba")
    died = fork_run(WORKERS / "ckpt_trainer.py", str(crash), *args, "--die-after", "17", timeout=300)
    assert died.returncode != 0
    assert (crash / "ckpt/last").resolve().name == "ep2-ba16"  # mid-epoch: 6 batches per epoch on 2 ranks
    manifest = json.loads((crash / "ckpt/last/manifest.json").read_text())
    assert manifest["strategy"]["name"] == "deepspeed"
    # The resumed run comes first in fresh processes, as after a real crash; the uninterrupted
    # reference then runs as a new Trainer in the same launch (--then), saving a launch. It
    # reseeds and builds everything anew, so what it inherits could only make it differ, not hide
    # a difference.
    check(
        fork_run(WORKERS / "ckpt_trainer.py", str(crash), *args, "--autoresume", "--then", str(run), *args, timeout=300)
    )
    for rank in (0, 1):
        x, y = (torch.load(d / f"final_rank{rank}.pt", weights_only=True) for d in (run, crash))
        assert x["batch"] == y["batch"] == 18  # 96 samples / (8 per batch * 2 ranks) * 3 epochs
        for section in ("model", "optimizer"):
            for key, value in x[section].items():
                same = (
                    torch.equal(value, y[section][key]) if isinstance(value, torch.Tensor) else value == y[section][key]
                )
                assert same, f"rank {rank}: {section}.{key} differs after the resume"


# -- configuration: kiln's settings fill deepspeed_config, contradictions are errors -----------------
def _strategy(**config):
    from kiln.parallel.deepspeed import DeepSpeed

    return DeepSpeed(config)


def test_kiln_settings_fill_the_config():
    s = _strategy(zero_optimization={"stage": 2})
    s.configure(gradient_accumulation=4, clip_grad_norm=0.5)
    assert s.config == {
        "zero_optimization": {"stage": 2},
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "train_micro_batch_size_per_gpu": 1,
    }
    s = _strategy(train_batch_size=64, gradient_clipping=2.0)
    s.configure(gradient_accumulation=1, clip_grad_norm=None)
    assert s.config["gradient_clipping"] == 2.0 and "train_micro_batch_size_per_gpu" not in s.config
    s = _strategy()
    s.configure(gradient_accumulation=1, clip_grad_norm=None)
    assert s.config["gradient_clipping"] == 0.0  # kiln's default, not DeepSpeed's 1.0


@pytest.mark.parametrize(
    "config, accum, clip, message",
    [
        (
            {"gradient_accumulation_steps": 4},
            1,
            None,
            r"deepspeed_config gradient_accumulation_steps=4 contradicts kiln's gradient_accumulation \(the Trainer's "
            r"grad_accum\)=1: kiln fills 'gradient_accumulation_steps' from gradient_accumulation \(the Trainer's "
            r"grad_accum\); drop it from deepspeed_config and set gradient_accumulation \(the Trainer's grad_accum\)=4",
        ),
        (
            {"gradient_clipping": 1.0},
            1,
            0.5,
            r"deepspeed_config gradient_clipping=1.0 contradicts kiln's clip_grad_norm=0.5",
        ),
    ],
)
def test_contradicting_settings_name_both(config, accum, clip, message):
    with pytest.raises(ValueError, match=message):
        _strategy(**config).configure(gradient_accumulation=accum, clip_grad_norm=clip)


@pytest.mark.parametrize(
    "config, precision, message",
    [
        (
            {"fp16": {"enabled": True}},
            "fp32",
            r"deepspeed_config enables 'fp16' but kiln's precision='fp32': set "
            r"precision='fp16' in kiln",
        ),
        ({"bf16": {"enabled": True}}, "fp16", r"deepspeed_config enables 'bf16' but kiln's precision='fp16'"),
        ({}, "amp_fp16", r"strategy='deepspeed' with precision='amp_fp16': .* use precision='fp16'"),
    ],
)
def test_precision_contradictions_fail_before_deepspeed_starts(config, precision, message):
    from kiln.launch.context import context
    from kiln.precision import get_precision

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        _strategy(**config).setup(model, torch.optim.SGD(model.parameters(), 0.1), context(), get_precision(precision))


def test_precision_fills_its_section():
    from kiln.parallel.deepspeed import DeepSpeed
    from kiln.precision import get_precision

    s = DeepSpeed({"bf16": {"immediate_grad_update": True}})
    s._fill_precision(get_precision("bf16"))
    assert s.config["bf16"] == {"immediate_grad_update": True, "enabled": True}


def test_config_file_errors(tmp_path):
    from kiln.parallel.deepspeed import DeepSpeed

    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 1}}')
    assert DeepSpeed(str(tmp_path / "ds.json")).config == {"zero_optimization": {"stage": 1}}
    (tmp_path / "bad.json").write_text("{stage: 1")
    with pytest.raises(ValueError, match=r"deepspeed_config='.*bad.json' could not be read as JSON"):
        DeepSpeed(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match=r"deepspeed_config=\[1\] must be a dict or the path of a JSON file"):
        DeepSpeed([1])


# -- the Trainer's Composer form: deepspeed_config= -------------------------------------------------
def _fit(**kwargs):
    import kiln

    kiln.seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=16),
        max_duration="3ep",
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        criterion=nn.CrossEntropyLoss(),
        grad_accum=2,
        progress_bar=False,
        **kwargs,
    )
    trainer.fit()
    return trainer


def test_trainer_deepspeed_config_on_one_process_equals_the_plain_run():
    # one process: kiln gives DeepSpeed the one-rank process group and LOCAL_RANK it insists on
    plain = _fit()
    ds = _fit(deepspeed_config={"zero_optimization": {"stage": 1}})
    assert ds.engine.strategy.name == "deepspeed" and ds.state.timestamp.batch.value == 12
    assert ds.engine.model.train_micro_batch_size_per_gpu() == 16  # from the loader, for DeepSpeed's logs
    from kiln.parallel import full_model_state_dict

    a, b = full_model_state_dict(plain.engine), full_model_state_dict(ds.engine)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name

    # A kiln time-aware scheduler drives the torch optimizer inside DeepSpeed's ZeRO wrapper. (In the
    # same test: DeepSpeed caches the one-rank group, which the test harness destroys between tests.)
    import kiln

    plain = _fit(schedulers=kiln.optim.CosineAnnealingScheduler())
    ds = _fit(deepspeed_config={"zero_optimization": {"stage": 2}}, schedulers=kiln.optim.CosineAnnealingScheduler())
    lrs = [group["lr"] for group in ds.state.optimizer.param_groups]
    assert lrs == [group["lr"] for group in plain.state.optimizer.param_groups] and lrs[0] < 1e-2
    a, b = full_model_state_dict(plain.engine), full_model_state_dict(ds.engine)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


def test_trainer_deepspeed_config_with_another_strategy_is_an_error():
    import kiln

    with pytest.raises(ValueError, match=r"deepspeed_config= is given with strategy='ddp': deepspeed_config selects"):
        kiln.Trainer(nn.Linear(2, 2), criterion=nn.CrossEntropyLoss(), strategy="ddp", deepspeed_config={})


# -- the Config CLI: compute_config.strategy: deepspeed ---------------------------------------------
@pytest.mark.world_size(2)
def test_cli_run_under_deepspeed_matches_ddp(tmp_path):
    # examples/mlp.yaml (grad accumulation 2, Adam) on 2 processes, checkpointing every step: the
    # per-step losses under DeepSpeed ZeRO-2 equal kiln ddp's
    from distributed import ROOT, fork_train

    def run(name, *extra):  # kiln train -f examples/mlp.yaml ... --nproc-per-node 2
        argv = [
            "-f",
            "examples/mlp.yaml",
            "--compute_config.use_zero",
            "false",
            "--max_train_steps",
            "4",
            "--enable_progress_bar",
            "false",
            "--checkpoint.save_dir",
            str(tmp_path / name),
            "--log.0.type",
            "file",
            "--log.0.args.path",
            str(tmp_path / f"{name}.jsonl"),
            *extra,
        ]
        check(fork_train(*argv, nproc=2, cwd=ROOT, timeout=300))
        lines = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        return {r["step"]: r["metrics"]["train/loss"] for r in lines if "train/loss" in r.get("metrics", {})}

    ddp = run("ddp", "--compute_config.strategy", "ddp")
    ds = run(
        "ds",
        "--compute_config.strategy",
        "deepspeed",
        "--compute_config.strategy_options",
        '{"deepspeed_config": {"zero_optimization": {"stage": 2}}}',
    )
    assert sorted(ds) == sorted(ddp) == [1, 2, 3, 4]
    for step, loss in ddp.items():
        assert ds[step] == pytest.approx(loss, abs=1e-6), f"step {step}"
    manifest = json.loads((tmp_path / "ds/last/manifest.json").read_text())
    assert manifest["strategy"]["name"] == "deepspeed"
