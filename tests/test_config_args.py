"""TrainerArgs: typed fields, batch arithmetic, component checks, and what build_trainer makes of them.

The dict-level parsing (dotted keys, deletion, references, __type) is in test_config_overrides.py.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "workers"))

import cli_models  # noqa: E402
from kiln.config import (  # noqa: E402
    CheckpointConfig,
    ConfigError,
    HookConfig,
    HookMapConfig,
    OptimizerConfig,
    TrainerArgs,
    build_trainer,
    check_components,
    dump_yaml,
    load_trainer_args,
    typed_overrides,
)
from kiln.config.reduction import as_end_to_end  # noqa: E402
from kiln.config.types import field_docs  # noqa: E402

BASE = {
    "model": {"type": "cli_models.TokenModel"},
    "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
    "dataset": {"type": "cli_models.TokenDataset", "train_args": {"size": 8}},
    "dataset_sampler": {"train_args": {"shuffle": False}},
    "checkpoint": {"no_save": True},
    "micro_batch_size": 2,
    "max_train_steps": 1,
    "enable_progress_bar": False,
    "seed": 0,
}


def _merge(base, extra):
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _args(world_size=1, **extra):
    return TrainerArgs.from_dict(_merge(BASE, extra)).resolve(world_size)


def _error(fn, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return info.value


@pytest.fixture(autouse=True)
def _fresh_record():
    cli_models.reset()
    yield


# -- fields and types -----------------------------------------------------------------------------
def test_keyword_only_and_types_checked_in_python():
    with pytest.raises(TypeError):
        CheckpointConfig("./x")  # keyword-only
    assert OptimizerConfig(type="torch.optim.SGD", clip_gnorm=1).clip_gnorm == 1.0  # int accepted for float
    e = _error(CheckpointConfig, every_n_epochs="2")
    assert e.path == "every_n_epochs" and "'2' (str)" in str(e)


def test_nested_errors_name_the_full_path():
    e = _error(TrainerArgs.from_dict, _merge(BASE, {"checkpoint": {"every_n_train_step": 1}}))
    assert e.path == "checkpoint.every_n_train_step"
    assert "did you mean 'every_n_train_steps'?" in str(e)
    e = _error(TrainerArgs.from_dict, {**BASE, "max_epoch": 2})
    assert "unknown key 'max_epoch' (did you mean 'max_epochs'?)" in str(e)
    e = _error(TrainerArgs.from_dict, _merge(BASE, {"log": [{"type": "console"}, {"type": "tensorbord"}]}))
    assert e.path == "log.1.type" and "did you mean 'tensorboard'?" in str(e)


def test_every_field_has_a_one_line_doc():
    from kiln.config import components
    from kiln.config.compute import ComputeConfig

    for cls in [
        TrainerArgs,
        ComputeConfig,
        *(getattr(components, n) for n in components.__all__ if n.endswith("Config")),
    ]:
        missing = [f.name for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
        assert not missing, f"{cls.__name__} fields without a doc line: {missing}"


def test_hook_union_is_picked_by_keys():
    assert isinstance(_args(hook={"type": "cli_models.TokenModel"}).hook, HookConfig)
    assert isinstance(_args(hook={"on_train_start": "cli_models.on_train_start"}).hook, HookMapConfig)
    e = _error(_args, hook={"on_train_strat": "x"})
    assert e.path == "hook.on_train_strat" and "did you mean 'on_train_start'?" in str(e)


def test_bare_logger_names_resolve_to_kiln_loggers():
    args = _args(log=[{"type": "console"}, {"type": "File", "args": {"path": "x"}}, {"type": "TensorBoardLogger"}])
    assert [log.type for log in args.log] == [
        "kiln.loggers.ConsoleLogger",
        "kiln.loggers.FileLogger",
        "kiln.loggers.TensorBoardLogger",
    ]


def test_precision_forms():
    assert _args(precision="bf16").precision == "bf16"
    assert _args(precision={"param": "bf16", "input": "none"}).precision == {"param": "bf16", "input": "none"}
    assert _error(_args, precision={"params": "bf16"}).path == "precision.params"
    assert _error(_args, precision={"param": "int8"}).path == "precision.param"


# -- overrides converted by field type --------------------------------------------------------------
def test_overrides_follow_field_types():
    got = dict(
        (k, v)
        for k, v, _ in typed_overrides(
            [
                "--checkpoint.save_dir",
                "001",
                "--max_epochs",
                "3",
                "--checkpoint.resume_from",
                "None",
                "--model.args.dim",
                "4",
                "--optimizer.args.betas",
                "(0.9, 0.99)",
                "--instance_name=1e3",
                "--precision",
                "{'param': 'bf16'}",
            ]
        )
    )
    assert got == {
        "checkpoint.save_dir": "001",
        "max_epochs": 3,
        "checkpoint.resume_from": None,
        "model.args.dim": 4,
        "optimizer.args.betas": (0.9, 0.99),
        "instance_name": "1e3",
        "precision": {"param": "bf16"},
    }


def test_list_items_can_be_added_by_index(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {type: cli_models.TokenModel}\noptimizer: {type: torch.optim.SGD, args: {lr: 0.1}}\n"
        "dataset: {type: cli_models.TokenDataset}\nmax_epochs: 1\n"
    )
    args = load_trainer_args(path, ["--log.0.type", "console", "--log.1.type", "file", "--log.1.args.path", "x"])
    assert [log.type for log in args.log] == ["kiln.loggers.ConsoleLogger", "kiln.loggers.FileLogger"]


def test_load_resolves_references_and_round_trips(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {type: cli_models.TokenModel, args: {dim: 4}}\n"
        "optimizer: {type: torch.optim.SGD, args: {lr: 0.1}}\n"
        "dataset: {type: cli_models.TokenDataset, train_args: {dim: $(model.args.dim)}}\n"
        "max_epochs: 1\nmicro_batch_size: 2\nglobal_batch_size: 8\n"
    )
    args = load_trainer_args(path, world_size=2)
    assert args.dataset.train_args["dim"] == 4 and args.grad_accumulation_steps == 2
    again = tmp_path / "again.yaml"
    again.write_text(dump_yaml(args))
    assert load_trainer_args(again, world_size=2) == args


# -- world-size arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "given, world, expected",
    [
        ({"micro_batch_size": 2}, 2, (4, 1)),
        ({"micro_batch_size": 2, "global_batch_size": 8}, 2, (8, 2)),
        ({"micro_batch_size": 2, "grad_accumulation_steps": 3}, 2, (12, 3)),
        ({"micro_batch_size": 2, "global_batch_size": 12, "grad_accumulation_steps": 3}, 2, (12, 3)),
        ({"micro_batch_size": 1, "global_batch_size": 8, "compute_config": {"plan_ngpus": 2}}, 4, (8, 4)),
    ],
)
def test_batch_arithmetic(given, world, expected):
    args = _args(world, **given)
    assert (args.global_batch_size, args.grad_accumulation_steps) == expected


@pytest.mark.parametrize(
    "given, world, path",
    [
        ({"micro_batch_size": 4, "global_batch_size": 10}, 1, "global_batch_size"),
        ({"micro_batch_size": 2, "global_batch_size": 8, "grad_accumulation_steps": 3}, 2, "grad_accumulation_steps"),
        ({"compute_config": {"runtime_ngpus": 4}}, 2, "compute_config.runtime_ngpus"),
        ({"compute_config": {"plan_ngpus": 3}}, 4, "compute_config.plan_ngpus"),
        ({"micro_batch_size": 0}, 1, "micro_batch_size"),
    ],
)
def test_batch_arithmetic_errors(given, world, path):
    e = _error(_args, world, **given)
    assert e.path == path and path in str(e)


def test_strategy_names():
    def name(world=2, **cc):
        args = _args(world, compute_config=cc)
        return args.compute_config.strategy_name(args.pas_policy, world)

    assert name() == "auto" and name(use_zero=True) == "zero1" and name(strategy="fsdp") == "fsdp"
    assert name(tp=2) == "hybrid" and name(1, use_zero=True) == "auto"
    assert _error(_args, 2, compute_config={"strategy": "fdsp"}).path == "compute_config.strategy"
    assert _error(_args, 2, pas_policy="mypkg.policy").path == "pas_policy"


def test_component_checks_name_the_field():
    assert _error(check_components, _args(model={"type": "cli_models.NoSuchModel"})).path == "model.type"
    e = _error(check_components, _args(model={"args": {"dimm": 3}}))
    assert e.path == "model.args" and "'dimm' -> 'dim'" in str(e)
    assert _error(check_components, _args(optimizer={"args": {"lrr": 1}})).path == "optimizer.args"
    e = _error(
        check_components,
        _args(dataset_sampler={"type": "torch.utils.data.DistributedSampler", "train_args": {"shufle": True}}),
    )
    assert e.path == "dataset_sampler.train_args"
    e = _error(check_components, _args(model={"args": {"dim": {"__type": "nope.Nothing"}}}))
    assert e.path == "model.args.dim.__type"
    assert _error(check_components, _args(hook={"on_train_start": "cli_models.nope"})).path == "hook.on_train_start"
    assert _error(_args, dataloader={"train_args": {"batch_size": 4}}).path == "dataloader.train_args.batch_size"
    e = _error(_args, checkpoint={"resume_from": "/no/such/checkpoint"})
    assert e.path == "checkpoint.resume_from"


# -- build_trainer ----------------------------------------------------------------------------------
def _fit(**extra):
    args = _args(**extra)
    check_components(args)
    trainer = build_trainer(args)
    trainer.fit()
    return trainer


def _hand_grads(params, microbatches, divisor):
    model = cli_models.TokenModel()
    model.load_state_dict(params)
    total = sum(cli_models.token_loss_sum(model, mb) for mb in microbatches)
    total.backward()
    return {n: p.grad / divisor for n, p in model.named_parameters()}, total.item()


def _samples(indices):
    data = cli_models.TokenDataset(size=8)
    return torch.utils.data.default_collate([data[i] for i in indices])


@pytest.mark.parametrize("reduction", ["mean", "sum", "per-token-mean"])
def test_grad_reduction_matches_hand_computation(reduction):
    trainer = _fit(
        global_batch_size=4,
        optimizer={"grad_reduction": reduction, "aggregate_outputs_fn": "cli_models.count_tokens"},
        hook={"before_optimizer_step": "cli_models.record_grads"},
    )
    microbatches = [_samples([0, 1]), _samples([2, 3])]
    tokens = sum(mb["mask"].sum() for mb in microbatches)
    divisor = {"mean": 2, "sum": 1, "per-token-mean": tokens}[reduction]
    expected, loss_sum = _hand_grads(cli_models.RECORD["params"][0], microbatches, divisor)
    for name, grad in cli_models.RECORD["grads"][0].items():
        torch.testing.assert_close(grad, expected[name])
    assert float(trainer.state.loss) == pytest.approx(loss_sum / 2)  # loss_reduction: mean over micro-batches


def test_sum_reduction_with_a_ragged_last_batch():
    # 7 samples, 4 per step: step 2 gets 3 samples, split into micro-batches of 2 and 1, each counted once
    _fit(
        global_batch_size=4,
        max_train_steps=2,
        dataset={"train_args": {"size": 7}},
        optimizer={"grad_reduction": "sum", "loss_reduction": "sum"},
        hook={"before_optimizer_step": "cli_models.record_grads"},
    )
    data = cli_models.TokenDataset(size=7)
    microbatches = [torch.utils.data.default_collate([data[i] for i in idx]) for idx in ([4, 5], [6])]
    expected, _ = _hand_grads(cli_models.RECORD["params"][1], microbatches, 1)
    for name, grad in cli_models.RECORD["grads"][1].items():
        torch.testing.assert_close(grad, expected[name])


@pytest.mark.parametrize(
    "precision, dtypes",
    [
        ({"param": "bf16", "buffer": "fp32", "input": "bf16"}, (torch.bfloat16, torch.float32, torch.bfloat16)),
        ({"param": "fp32", "buffer": "bf16"}, (torch.float32, torch.bfloat16, torch.float32)),
        ("bf16", (torch.bfloat16, torch.bfloat16, torch.bfloat16)),
    ],
)
def test_per_tensor_type_precision(precision, dtypes):
    trainer = _fit(model={"type": "cli_models.DtypeModel"}, precision=precision)
    model = trainer.state.model
    assert (model.proj.weight.dtype, model.scale.dtype, cli_models.RECORD["input_dtypes"][0]) == dtypes


def test_end_to_end_model_keeps_its_class_name_and_keys():
    model = cli_models.TokenModel()
    keys = list(model.state_dict())
    wrapped = as_end_to_end(model)
    assert wrapped is model and type(model).__name__ == "TokenModel" and list(model.state_dict()) == keys
    assert model.loss((torch.tensor(2.0), 3), None) == 2.0
    assert isinstance(model, cli_models.TokenModel) and isinstance(model, __import__("kiln").Model)


def test_hook_points_fire_in_nnscaler_order():
    names = [
        "after_setup",
        "on_train_start",
        "on_epoch_start",
        "on_train_step_start",
        "before_zero_grad",
        "after_zero_grad",
        "after_aggregate_train_step_outputs",
        "before_gnorm_clip",
        "after_gnorm_clip",
        "before_optimizer_step",
        "after_optimizer_step",
        "on_train_step_end",
        "on_val_start",
        "on_val_step_start",
        "on_val_step_end",
        "on_val_end",
        "on_train_end",
    ]
    _fit(
        hook={n: f"cli_models.{n}" for n in names},
        dataset={"val_args": {"size": 2}},
        val_every_n_train_steps=1,
        micro_batch_size=2,
        optimizer={"clip_gnorm": 1.0},
    )
    assert cli_models.RECORD["points"] == names


def test_before_optimizer_step_sees_clipped_gradients_and_clipping_happens_once():
    # nnScaler's order: clip, after_gnorm_clip(norm before clipping), before_optimizer_step, step
    clipped = _fit(
        hook={"before_optimizer_step": "cli_models.record_grads"}, optimizer={"clip_gnorm": 1e-3}, max_train_steps=2
    )
    grads = cli_models.RECORD["grads"]
    assert len(grads) == 2
    for step in grads:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in step.values()]))
        assert norm <= 1e-3 * (1 + 1e-5), f"before_optimizer_step saw unclipped gradients (norm {norm:.3g})"
    cli_models.RECORD.clear()
    cli_models.RECORD.update({"points": [], "grads": [], "params": [], "loaded": [], "input_dtypes": []})
    plain = _fit(optimizer={"clip_gnorm": 1e-3}, max_train_steps=2)  # the Engine clips inside its step
    for name, value in plain.state.model.state_dict().items():
        assert torch.equal(value, clipped.state.model.state_dict()[name]), name


def test_checkpoint_hooks_and_resume_in_process(tmp_path):
    folder = str(tmp_path / "ck")
    hook = {"on_save_checkpoint": "cli_models.save_extra", "on_load_checkpoint": "cli_models.load_extra"}
    first = _fit(checkpoint={"no_save": False, "save_dir": folder, "every_n_train_steps": 1}, hook=hook)
    assert first.state.timestamp.batch.value == 1
    second = _fit(
        checkpoint={"no_save": False, "save_dir": folder, "every_n_train_steps": 1, "resume_from": "last"},
        hook=hook,
        max_train_steps=3,
    )
    assert cli_models.RECORD["loaded"] == [{"note": "saved at 1"}]
    assert second.state.timestamp.batch.value == 3
    assert sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("ep")) == [
        "ep0-ba1",
        "ep0-ba2",
        "ep0-ba3",
    ]


def test_resume_from_last_in_an_object_store_with_storage_options():
    """save_dir may be an fsspec URL: its storage_options reach the Trainer, and resume_from: last
    finds the pointer object there (a local-path check would miss it and start afresh)."""
    import uuid

    from kiln.checkpoint.storage import as_path

    pytest.importorskip("fsspec")
    folder = f"memory://kiln-cfg-{uuid.uuid4().hex[:8]}"
    hook = {"on_save_checkpoint": "cli_models.save_extra", "on_load_checkpoint": "cli_models.load_extra"}
    options = {"skip_instance_cache": False}
    ckpt = {"no_save": False, "save_dir": folder, "every_n_train_steps": 1, "storage_options": options}
    first = _fit(checkpoint=ckpt, hook=hook)
    assert first.options.checkpointing.storage_options == options
    second = _fit(checkpoint={**ckpt, "resume_from": "last"}, hook=hook, max_train_steps=3)
    assert cli_models.RECORD["loaded"] == [{"note": "saved at 1"}]
    assert second.state.timestamp.batch.value == 3
    assert sorted(p.name for p in as_path(folder).iterdir()) == ["ep0-ba1", "ep0-ba2", "ep0-ba3", "last"]
    as_path(folder).rmtree()


def test_durations_schedulers_init_env_and_initial_weights(tmp_path):
    # 8 samples / 2 per step = 4 steps per epoch: max_epochs 1 ends before max_train_steps 10
    assert str(_fit(max_epochs=1, max_train_steps=10).state.max_duration.unit.value) == "ep"
    assert _fit(max_epochs=3, max_train_steps=2).state.timestamp.batch.value == 2
    weights = tmp_path / "w.pt"
    initial = cli_models.TokenModel()
    torch.save(initial.state_dict(), weights)
    trainer = _fit(
        max_train_steps=2,
        init_env_fn="cli_models.init_env",
        tracing_from_weights=str(weights),
        lr_scheduler={
            "type": "torch.optim.lr_scheduler.StepLR",
            "args": {"step_size": 1, "gamma": 0.5},
            "interval": "step",
        },
        hook={"before_optimizer_step": "cli_models.record_grads"},
    )
    assert cli_models.RECORD["points"] == [("init_env", 2)]
    torch.testing.assert_close(cli_models.RECORD["params"][0]["proj.weight"], initial.proj.weight)
    assert trainer.state.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.25)  # stepped every step


def test_compile_mode_builds_without_training(tmp_path, capsys, monkeypatch):
    from kiln.cli.train import run_training

    args = _args(run_mode="compile", checkpoint={"no_save": False, "save_dir": str(tmp_path / "ck")})
    assert run_training(args) == 0
    out = capsys.readouterr().out
    assert "kiln train (compile): model TokenModel with 4 parameters" in out and "global_batch_size 2" in out
    assert not (tmp_path / "ck").exists()


def test_python_file_and_dict_sources(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(
        "import math\nmodel = dict(type='cli_models.TokenModel', args=dict(dim=3))\n"
        "optimizer = {'type': 'torch.optim.SGD', 'args': {'lr': math.sqrt(0.01)}}\n"
        "dataset = {'type': 'cli_models.TokenDataset'}\nmax_epochs = 1\n"
    )
    from_py = load_trainer_args(path, ["--max_epochs", "2"])
    assert from_py.optimizer.args["lr"] == pytest.approx(0.1) and from_py.max_epochs == 2
    assert load_trainer_args(from_py.to_dict()) == from_py
    (tmp_path / "bad.py").write_text("model = 1 / 0\n")
    e = _error(load_trainer_args, tmp_path / "bad.py")
    assert "ZeroDivisionError" in str(e)
