"""kiln means what Composer, Colossal-AI and nnScaler mean where it takes their words (issue 12).

Every expected value is the peer's documented behaviour, computed by hand here: closed forms of the
learning rate at chosen batches under scale_schedule_ratio 0.5, 1 and 2, exact strings for
``__value_type``, the resolved YAML for ``vars:``.
"""

from __future__ import annotations

import datetime
import math
import types

import pytest
import torch
from torch import nn

import kiln
from kiln.config.args import TrainerArgs, load_trainer_args, typed_overrides
from kiln.config.overrides import ConfigError
from kiln.core.time import Time, Timestamp, TimeUnit
from kiln.optim import (
    ConstantWithWarmupScheduler,
    CosineAnnealingWithWarmupScheduler,
    LinearScheduler,
    LinearWithWarmupScheduler,
    MultiStepScheduler,
    PolynomialWithWarmupScheduler,
    compile_composer_scheduler,
)
from kiln.optim.lr_scheduler import scale_torch_scheduler

BASE_LR = 0.1


def _data(n=64, dim=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


class LRAtBatchEnd(kiln.Callback):
    """The optimizer's lr after each batch's scheduler step, by batch number (Composer's timestamp)."""

    def __init__(self):
        self.lr = {}

    def run_event(self, event, state, logger):
        if event == kiln.Event.BATCH_END:
            self.lr[state.timestamp.batch.value] = state.optimizer.param_groups[0]["lr"]


def _fit(schedulers=None, make_schedulers=None, batch_size=4, callbacks=(), **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR)
    if make_schedulers is not None:
        schedulers = make_schedulers(opt)
    rec = LRAtBatchEnd()
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=batch_size),
        optimizers=opt,
        criterion=nn.CrossEntropyLoss(),
        schedulers=schedulers,
        progress_bar=False,
        callbacks=[rec, *callbacks],
        **kw,
    )
    trainer.fit()
    return trainer, rec.lr


# ---- 1. scale_schedule_ratio scales a schedule once ---------------------------------------------------


@pytest.mark.parametrize("ssr", [0.5, 1.0, 2.0])
def test_trainer_linear_schedule_ends_with_the_scaled_run(ssr):
    # Composer: max_duration 50ba * ssr; `1dur` is the whole scaled run, so the lr reaches alpha_f
    # exactly at the last batch, not halfway (the double scaling made it batch 13 of 25).
    trainer, lr = _fit(LinearScheduler(alpha_i=1.0, alpha_f=0.1), max_duration="50ba", scale_schedule_ratio=ssr)
    n = int(50 * ssr)
    assert trainer.state.timestamp.batch.value == n and sorted(lr) == list(range(1, n + 1))
    for k in range(1, n + 1):
        assert lr[k] == pytest.approx(BASE_LR * (1.0 + (0.1 - 1.0) * k / n), rel=1e-12)
    assert lr[n] == pytest.approx(BASE_LR * 0.1, rel=1e-12) and lr[n - 1] > lr[n]


@pytest.mark.parametrize("ssr", [0.5, 1.0, 2.0])
def test_trainer_milestones_in_batches_and_epochs_scale_once(ssr):
    # 64 samples / batch 4 = 16 batches per epoch. "1ep" -> 16 * ssr batches, "40ba" -> 40 * ssr,
    # "0.5dur" -> half of the scaled 64 * ssr batches: each milestone scales by the ratio once.
    sched = MultiStepScheduler(milestones=["1ep", "40ba", "0.5dur"], gamma=0.5)
    _, lr = _fit(sched, max_duration="4ep", scale_schedule_ratio=ssr)
    n = int(64 * ssr) if ssr != 0.5 else 32
    milestones = [int(16 * ssr), int(40 * ssr), int(0.5 * n)]
    assert sorted(lr) == list(range(1, n + 1))
    assert [lr[k] for k in lr] == [BASE_LR * 0.5 ** sum(k >= m for m in milestones) for k in lr]


@pytest.mark.parametrize(
    ("ssr", "scale_warmup", "warm"),
    [
        (0.5, False, 10),
        (1.0, False, 10),
        (2.0, False, 10),
        (0.5, True, 5),
        (2.0, True, 20),
    ],
)
def test_warmup_schedule_ends_with_the_scaled_run(ssr, scale_warmup, warm):
    # Warmup stays 10 batches unless scale_warmup; the cosine always ends at the scaled run's end.
    sched = CosineAnnealingWithWarmupScheduler(t_warmup="10ba", alpha_f=0.05, scale_warmup=scale_warmup)
    _, lr = _fit(sched, max_duration="40ba", scale_schedule_ratio=ssr)
    n = int(40 * ssr)

    def closed_form(k):
        if k < warm:
            return k / warm
        return 0.05 + 0.95 * (1 + math.cos(math.pi * (k - warm) / (n - warm))) / 2

    assert [lr[k] for k in range(1, n + 1)] == pytest.approx(
        [BASE_LR * closed_form(k) for k in range(1, n + 1)], rel=1e-12
    )
    assert lr[n] == pytest.approx(BASE_LR * 0.05, rel=1e-12)


# ---- 2. torch schedulers follow the ratio -----------------------------------------------------------


@pytest.mark.parametrize("ssr", [0.5, 1.0, 2.0])
def test_trainer_scales_torch_cosine_t_max(ssr):
    # CosineAnnealingLR(T_max=40) stepped per batch over 40ba: with ssr the run and T_max both
    # become 40 * ssr, so the last batch ends at eta_min (Composer's scale_pytorch_scheduler).
    _, lr = _fit(
        make_schedulers=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40, eta_min=0.01),
        max_duration="40ba",
        scale_schedule_ratio=ssr,
        step_schedulers_every_batch=True,
    )
    n = int(40 * ssr)
    expected = [0.01 + (BASE_LR - 0.01) * (1 + math.cos(math.pi * k / n)) / 2 for k in range(1, n + 1)]
    assert [lr[k] for k in range(1, n + 1)] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert lr[n] == pytest.approx(0.01, abs=1e-12)


@pytest.mark.parametrize("ssr", [0.5, 1.0, 2.0])
def test_trainer_scales_step_multistep_and_exponential(ssr):
    def make(opt):
        return [
            torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5),
            torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[16, 24], gamma=0.1),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
        ]

    _, lr = _fit(make_schedulers=make, max_duration="32ba", scale_schedule_ratio=ssr, step_schedulers_every_batch=True)
    n, step, milestones = int(32 * ssr), int(10 * ssr), [int(16 * ssr), int(24 * ssr)]
    expected = [
        BASE_LR * 0.5 ** (k // step) * 0.1 ** sum(k >= m for m in milestones) * 0.9 ** (k / ssr)
        for k in range(1, n + 1)
    ]
    assert [lr[k] for k in range(1, n + 1)] == pytest.approx(expected, rel=1e-9)


def test_torch_schedulers_that_cannot_be_scaled_are_refused():
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"scale_schedule_ratio=0.5 cannot scale LinearLR: .*f\(state, ssr\)"):
        scale_torch_scheduler(torch.optim.lr_scheduler.LinearLR(opt), 0.5)
    with pytest.raises(ValueError, match="step_size=1 round down to 0"):
        scale_torch_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=1), 0.5)
    from kiln.optim.colossal import CosineAnnealingLR as ColossalCosine

    with pytest.raises(ValueError, match="total_steps"):
        scale_torch_scheduler(ColossalCosine(opt, total_steps=10), 2.0)
    restarts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=10)
    scale_torch_scheduler(restarts, 0.5)
    assert (restarts.T_0, restarts.T_i) == (5, 5)
    linear = torch.optim.lr_scheduler.LinearLR(opt)
    scale_torch_scheduler(linear, 1.0)  # ratio 1: nothing to scale, nothing refused


# ---- 5. a scheduler may be a function ---------------------------------------------------------------


def test_function_schedulers_with_one_and_two_arguments():
    def halve_after_5(state):
        return 1.0 if state.timestamp.batch.value < 5 else 0.5

    def linear(state, ssr):
        return 1.0 - state.timestamp.batch.value / state.max_duration.value

    _, lr = _fit(halve_after_5, max_duration="8ba")
    assert [lr[k] for k in range(1, 9)] == [BASE_LR * (1.0 if k < 5 else 0.5) for k in range(1, 9)]
    _, lr = _fit(linear, max_duration="8ba", scale_schedule_ratio=2.0)
    assert [lr[k] for k in range(1, 17)] == pytest.approx([BASE_LR * (1 - k / 16) for k in range(1, 17)], rel=1e-12)
    with pytest.raises(ValueError, match=r"takes only \(state\).*scale_schedule_ratio=0.5"):
        _fit(halve_after_5, max_duration="8ba", scale_schedule_ratio=0.5)
    state = types.SimpleNamespace(timestamp=Timestamp(), max_duration=Time(4, "ba"))
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="cannot follow scale_schedule_ratio=2"):
        compile_composer_scheduler(lambda s: 1.0, state, opt, ssr=2.0)


# ---- 6. train_subset_num_batches ------------------------------------------------------------------


def test_train_subset_num_batches_trains_the_first_n_batches_of_each_epoch():
    seen = []

    class Batches(kiln.Callback):
        def run_event(self, event, state, logger):
            if event == kiln.Event.AFTER_DATALOADER:
                seen.append((state.timestamp.epoch.value, state.batch[0][0, 0].item()))

    loader_first = [b[0][0, 0].item() for b in torch.utils.data.DataLoader(_data(), batch_size=4)]
    # 16 batches per epoch, 5 of them trained: 3 epochs are 15 batches, "1dur" = 15 batches.
    trainer, lr = _fit(
        LinearScheduler(alpha_f=0.2), max_duration="3ep", train_subset_num_batches=5, callbacks=[Batches()]
    )
    assert trainer.state.timestamp.batch.value == 15 and trainer.state.timestamp.epoch.value == 3
    assert trainer.state.dataloader_len == 5
    assert [e for e, _ in seen] == [0] * 5 + [1] * 5 + [2] * 5
    assert [x for _, x in seen[:5]] == loader_first[:5]  # the loader here is not shuffled: its first 5
    assert [lr[k] for k in range(1, 16)] == pytest.approx([BASE_LR * (1 - 0.8 * k / 15) for k in range(1, 16)])
    assert lr[15] == pytest.approx(BASE_LR * 0.2, rel=1e-12)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="train_subset_num_batches"):
            _fit(max_duration="1ep", train_subset_num_batches=bad)
    trainer, _ = _fit(max_duration="1ep", train_subset_num_batches=-1)  # Composer's "all batches"
    assert trainer.state.timestamp.batch.value == 16


# ---- 7. Composer's Time forms -----------------------------------------------------------------------


def test_time_strings_take_digit_separators():
    assert Time.from_timestring("4_000tok") == Time(4000, TimeUnit.TOKEN)
    assert Time.from_timestring("1_000ba") == Time(1000, TimeUnit.BATCH)
    assert Time.from_timestring("1_0.2_5sec") == Time(10.25, TimeUnit.SECOND)
    assert Time.from_timestring("1_0h") == Time(36000.0, TimeUnit.SECOND)
    for bad in ("_1000ba", "1000_ba", "1__000ba", "1_000_ba"):
        with pytest.raises(ValueError, match="invalid time string"):
            Time.from_timestring(bad)


def test_timestamp_copy_and_composer_advance_signatures():
    ts = Timestamp(epoch=1, batch=10, sample=40, batch_in_epoch=2, total_wct=3.0)
    copy = ts.copy(batch=Time(12, "ba"), sample=48, epoch=None, batch_wct=datetime.timedelta(seconds=1.5))
    assert copy.state_dict() == {**ts.state_dict(), "batch": 12, "sample": 48, "batch_wct": 1.5}
    assert ts.batch.value == 10  # the original is untouched
    with pytest.raises(TypeError, match="unknown field.*'iteration'"):
        ts.copy(iteration=1)
    # Composer's callbacks: to_next_batch(samples, tokens, duration=timedelta) and to_next_epoch(duration)
    nxt = ts.to_next_batch(samples=Time(4, "sp"), tokens=16, duration=datetime.timedelta(seconds=0.5))
    assert (nxt.batch.value, nxt.sample.value, nxt.token.value, nxt.total_wct, nxt.batch_wct) == (11, 44, 16, 3.5, 0.5)
    assert ts.batch.value == 10
    after = nxt.to_next_epoch(duration=datetime.timedelta(seconds=2))
    assert (after.epoch.value, after.batch_in_epoch.value, after.total_wct, after.epoch_wct, after.batch_wct) == (
        2,
        0,
        5.5,
        0.0,
        0.0,
    )
    ts.advance_batch()  # Composer's defaults: 0 samples, 0 tokens, no duration
    ts.advance_batch(4, duration=None)
    ts.advance_epoch(datetime.timedelta(seconds=1))
    assert (ts.batch.value, ts.sample.value, ts.epoch.value, ts.total_wct) == (12, 44, 2, 4.0)
    with pytest.raises(ValueError, match="samples='4' must be a non-negative int"):
        ts.advance_batch("4")


# ---- 8. a warmup schedule shorter than the run raises ---------------------------------------------------


@pytest.mark.parametrize(
    "cls",
    [
        LinearWithWarmupScheduler,
        ConstantWithWarmupScheduler,
        CosineAnnealingWithWarmupScheduler,
        PolynomialWithWarmupScheduler,
    ],
)
def test_warmup_t_max_shorter_than_max_duration_raises_at_fit_start(cls):
    with pytest.raises(ValueError, match=r"t_max=30ba ends at 30ba, before max_duration \(40ba\).*allow_short_t_max"):
        _fit(cls(t_warmup="5ba", t_max="30ba"), max_duration="40ba")
    # the ratio scales t_max and the run alike: 30ba * 2 = 60 < 80
    with pytest.raises(ValueError, match=r"ends at 60ba at scale_schedule_ratio=2, before max_duration \(80ba\)"):
        _fit(cls(t_warmup="5ba", t_max="30ba"), max_duration="40ba", scale_schedule_ratio=2.0)
    # epochs against batches compare through the epoch length (16 batches): 2ep = 32 < 48
    with pytest.raises(ValueError, match=r"before max_duration \(48ba\)"):
        _fit(cls(t_warmup="5ba", t_max="2ep"), max_duration="3ep")
    _fit(cls(t_warmup="5ba", t_max="40ba"), max_duration="40ba")  # t_max == max_duration is fine


def test_fit_with_a_new_duration_checks_t_max_again():
    sched = LinearWithWarmupScheduler(t_warmup="2ba", t_max="20ba", alpha_f=0.5)
    trainer, _ = _fit(sched, max_duration="20ba")
    with pytest.raises(ValueError, match="before max_duration"):
        trainer.fit(duration="10ba")  # the run would now reach batch 30
    assert trainer.state.timestamp.batch.value == 20  # refused before any batch trained


def test_allow_short_t_max_holds_the_final_value():
    sched = LinearWithWarmupScheduler(t_warmup="2ba", t_max="10ba", alpha_f=0.5, allow_short_t_max=True)
    _, lr = _fit(sched, max_duration="16ba")
    assert [lr[k] for k in range(1, 17)] == pytest.approx(
        [BASE_LR * (k / 2 if k < 2 else 1 - 0.5 * min(1.0, (k - 2) / 8)) for k in range(1, 17)], rel=1e-12
    )
    assert lr[16] == lr[10] == pytest.approx(BASE_LR * 0.5)


# ---- 3. __value_type values are not guessed -----------------------------------------------------------


def _built(argv, cfg=None):
    from kiln.config.build import build_value
    from kiln.config.overrides import apply_overrides

    return build_value(apply_overrides(cfg or {}, typed_overrides(argv, cfg)))


def test_value_type_value_keeps_the_command_line_text():
    # nnScaler: value_type(raw text); nothing is guessed first ('1e3', not '1000.0').
    argv = ["--model.args.name.__value_type", "str", "--model.args.name.value", "1e3"]
    assert _built(argv)["model"]["args"]["name"] == "1e3"
    argv = ["--model.args.name.value=007", "--model.args.name.__value_type=str"]  # order does not matter
    assert _built(argv)["model"]["args"]["name"] == "007"
    assert _built(["--x.__value_type", "float", "--x.value", "1e3"])["x"] == 1000.0
    assert _built(["--x.__value_type", "int", "--x.value", "007"])["x"] == 7
    cfg = {"model": {"args": {"tag": {"__value_type": "str", "value": "1"}}}}  # __value_type from the YAML
    assert _built(["--model.args.tag.value", "[1, 2]"], cfg)["model"]["args"]["tag"] == "[1, 2]"
    assert _built(["--model.args.value", "1e3"])["model"]["args"]["value"] == 1000.0  # no __value_type: guessed


# ---- 4. nnScaler YAML that kiln used to refuse ------------------------------------------------------

NNSCALER_YAML = """\
vars:
  dim: 16
  lr: 0.01
  tag: small
model:
  type: cli_models.TokenModel
  args: {dim: $(vars.dim)}
optimizer:
  type: torch.optim.SGD
  args: {lr: $(vars.lr)}
dataset:
  type: cli_models.TokenDataset
  train_args: {size: 8}
checkpoint: {no_save: true}
instance_name: run-$(vars.tag)-$(vars.dim)
micro_batch_size: 2
max_train_steps: 1
enable_progress_bar: false
"""


def test_vars_section_is_resolved_and_dropped(tmp_path):
    import yaml

    from kiln.config.args import dump_yaml

    path = tmp_path / "run.yaml"
    path.write_text(NNSCALER_YAML)
    args = load_trainer_args(path, ["--vars.dim", "32"], world_size=1, check=False)
    resolved = yaml.safe_load(dump_yaml(args))
    assert "vars" not in resolved
    assert resolved["model"] == {"type": "cli_models.TokenModel", "args": {"dim": 32}}
    assert resolved["optimizer"]["args"] == {"lr": 0.01}
    assert resolved["instance_name"] == "run-small-32"
    # the dump reads back to the same arguments (vars are gone, their values stay)
    assert load_trainer_args(resolved, world_size=1, check=False) == args
    path.write_text(NNSCALER_YAML.replace("vars:\n  dim: 16\n  lr: 0.01\n  tag: small\n", "vars: [1, 2]\n"))
    with pytest.raises(ConfigError, match=r"^vars: got \[1, 2\] \(list\), expected a mapping"):
        load_trainer_args(path, world_size=1, check=False)


def _yaml_args(tmp_path, argv, text=NNSCALER_YAML):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_trainer_args(path, argv, world_size=1, check=False)


def test_bare_boolean_flags_mean_true(tmp_path):
    args = _yaml_args(tmp_path, ["--enable_progress_bar", "--compute_config.use_zero", "--max_train_steps", "3"])
    assert args.enable_progress_bar is True and args.compute_config.use_zero is True and args.max_train_steps == 3
    assert _yaml_args(tmp_path, ["--max_train_steps", "3", "--enable_progress_bar"]).enable_progress_bar is True
    assert _yaml_args(tmp_path, ["--enable_progress_bar", "false"]).enable_progress_bar is False
    with pytest.raises(ConfigError, match="max_train_steps: no value given for '--max_train_steps'"):
        _yaml_args(tmp_path, ["--max_train_steps", "--enable_progress_bar"])


def make_name(prefix: str, dim: int) -> str:
    """Used by name as instance_name.__type below."""
    return f"{prefix}-{dim * 2}"


def test_type_builds_a_string_field_with_a_function(tmp_path):
    argv = [
        "--instance_name.__type",
        "test_peer_compat.make_name",
        "--instance_name.prefix",
        "exp",
        "--instance_name.dim",
        "$(vars.dim)",
    ]
    assert _yaml_args(tmp_path, argv).instance_name == "exp-32"
    text = NNSCALER_YAML + "checkpoint: {no_save: true, save_dir: {__value_type: str, value: '001'}}\n"
    assert _yaml_args(tmp_path, [], text).checkpoint.save_dir == "001"
    with pytest.raises(ConfigError, match="instance_name.__type: cannot import 'test_peer_compat.nope'"):
        _yaml_args(tmp_path, ["--instance_name.__type", "test_peer_compat.nope"])
    # a component's args are built with the component, not while the config is read
    args = _yaml_args(tmp_path, ["--model.args.block.__type", "test_peer_compat.nope"])
    assert args.model.args["block"] == {"__type": "test_peer_compat.nope"}


def _strategy(world=4, pas_policy="autodist", **cc):
    args = TrainerArgs.from_dict(
        {
            "model": {"type": "m.M"},
            "optimizer": {"type": "o.O"},
            "dataset": {"type": "d.D"},
            "max_epochs": 1,
            "pas_policy": pas_policy,
            "compute_config": cc,
        }
    )
    return args.compute_config.strategy_name(pas_policy, world), args.compute_config.mesh_degrees(pas_policy)


def test_pas_policy_builtin_names_map_to_kiln_strategies():
    assert _strategy(pas_policy="autodist") == ("auto", (1, 1))
    assert _strategy(pas_policy="dp") == ("ddp", (1, 1))
    assert _strategy(pas_policy="data") == ("ddp", (1, 1))
    assert _strategy(pas_policy="dp", use_zero=True) == ("zero1", (1, 1))
    assert _strategy(pas_policy="tp", plan_ngpus=2) == ("hybrid", (2, 1))  # tensor parallel over plan_ngpus
    assert _strategy(pas_policy="tp") == ("ddp", (1, 1))  # one GPU per replica: nothing to split
    assert _strategy(pas_policy="hybrid", tp=2) == ("hybrid", (2, 1))
    assert _strategy(pas_policy="tp", strategy="fsdp", plan_ngpus=2)[0] == "fsdp"  # the strategy field wins


@pytest.mark.parametrize(
    ("policy", "cc", "path", "text"),
    [
        ("pp", {"plan_ngpus": 2}, "pas_policy", "compute_config.pp N and compute_config.strategy_options.split_points"),
        ("hybrid", {"plan_ngpus": 2}, "pas_policy", "set compute_config.tp and compute_config.pp"),
        ("dp", {"plan_ngpus": 2}, "compute_config.plan_ngpus", "use pas_policy 'tp'"),
        ("mypkg.my_policy", {}, "pas_policy", "kiln does not run policy functions: set compute_config.strategy"),
        ("autodst", {}, "pas_policy", "(did you mean 'autodist'?)"),
    ],
)
def test_pas_policy_refusals_say_what_to_write(policy, cc, path, text):
    with pytest.raises(ConfigError) as info:
        _strategy(pas_policy=policy, **cc)
    assert info.value.path == path and text in str(info.value) and str(info.value).startswith(path)
