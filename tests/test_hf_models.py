"""Hugging Face models: kiln.models.HuggingFaceModel, the tensor-parallel plan they bring, and
``kiln checkpoint export --hf``.

The tiny Llama of tests/workers/hf_common.py (float64, 2 layers, 8 heads / 4 key/value heads, byte
tokens of a standard-library source file) trains 2 AdamW steps under ddp, zero1, zero3, tp (its own
plan), zero3 x tp, pp (x ddp) and pp x tp in one 4-rank launch and must give the one-process losses
(and evaluation) within 1e-10 per step. (The Engine's own loop under zero3 x tp with the model's
loss is tests/test_sequence_parallel.py's llama_fsdp2_tp2.) A run of
the config CLI on 2 ranks under zero3 is exported with ``--hf``; transformers loads the folder and
its logits equal kiln's eval logits. Everything else runs in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from distributed import ROOT, WORKERS, base_env, check, fork_run, fork_train  # noqa: E402

sys.path.insert(0, str(WORKERS))
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
)

import kiln  # noqa: E402
from hf_common import CONFIG, LAYERS, ByteWindows, batches, make_llama, make_model  # noqa: E402
from kiln.cli.main import main as kiln_main  # noqa: E402
from kiln.models import HuggingFaceModel  # noqa: E402
from kiln.models.tp_plan import huggingface_tp_plan  # noqa: E402
from kiln.parallel.transforms.tensor_parallel import check_tp_size, model_tp_plan, resolve_tp_plan  # noqa: E402

SMALL = {**CONFIG, "num_hidden_layers": 2}
BASE_PLAN = LlamaConfig().base_model_tp_plan


def _batch(rows: int = 2) -> dict[str, torch.Tensor]:
    return batches(1, rows)[0]


# -- the wrapper ------------------------------------------------------------------------------------
def test_a_causal_lm_runs_dict_batches_takes_its_loss_and_reports_perplexity():
    model = HuggingFaceModel(make_llama(num_hidden_layers=2))
    assert (model.task, model.shift_labels) == ("causal_lm", True)
    batch = _batch()
    out = model(batch)
    assert model.loss(out, batch) is out.loss  # the output's own loss
    assert torch.equal(model.eval_forward(batch, out), out.logits)  # eval outputs: the logits
    metrics = model.get_metrics()
    assert list(metrics) == ["LanguagePerplexity"]
    model.update_metric(batch, model.eval_forward(batch, out), metrics["LanguagePerplexity"])
    # next-token perplexity over the batch's tokens: exp of the causal-LM loss
    assert metrics["LanguagePerplexity"].compute().item() == pytest.approx(out.loss.exp().item(), rel=1e-12)
    assert model.get_metrics()["LanguagePerplexity"] is not metrics["LanguagePerplexity"]  # fresh each time


def test_without_labels_in_the_forward_the_loss_is_the_shifted_cross_entropy():
    # what a pipeline does: its stages get pipeline_inputs(batch), the loss the whole batch
    model = HuggingFaceModel(make_llama(num_hidden_layers=2))
    batch = _batch()
    inputs = model.pipeline_inputs(batch)
    assert set(inputs) == {"input_ids"}
    with_labels = model(batch)
    without = model(inputs)
    assert "loss" not in without or without.loss is None
    for outputs in (without, without.to_tuple()):  # a pipeline's last stage returns the tuple form
        assert model.loss(outputs, batch).item() == pytest.approx(with_labels.loss.item(), rel=1e-13)
        assert torch.equal(model.eval_forward(batch, outputs), with_labels.logits)
    assert model.loss(with_labels.to_tuple(), batch) is with_labels.loss  # (loss, logits, ...)


def test_a_classifier_defaults_to_accuracy_without_shifting():
    config = LlamaConfig(**SMALL, num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    model = HuggingFaceModel(LlamaForSequenceClassification(config).double())
    assert (model.task, model.shift_labels) == ("classification", False)
    batch = {"input_ids": _batch(4)["input_ids"], "labels": torch.tensor([0, 1, 2, 1])}
    logits = model.eval_forward(batch)
    metric = model.get_metrics()["Accuracy"]
    model.update_metric(batch, logits, metric)
    assert metric.compute().item() == pytest.approx((logits.argmax(-1) == batch["labels"]).double().mean().item())


def test_user_metrics_and_shift_labels_win():
    from kiln.metrics import CrossEntropy

    model = HuggingFaceModel(make_llama(num_hidden_layers=2), metrics=[CrossEntropy()], shift_labels=False)
    assert list(model.get_metrics()) == ["CrossEntropy"] and not model.shift_labels


def test_wrong_inputs_say_what_to_do():
    with pytest.raises(TypeError, match="takes a transformers model"):
        HuggingFaceModel(nn.Linear(2, 2))
    model = HuggingFaceModel(make_llama(num_hidden_layers=2))
    with pytest.raises(TypeError, match="takes dict batches"):
        model((torch.zeros(2, 4, dtype=torch.long),))
    inputs = {"input_ids": _batch()["input_ids"]}
    with pytest.raises(ValueError, match="no 'labels'.*input_ids"):
        model.loss(model(inputs), inputs)
    with pytest.raises(TypeError, match=r"metrics\['x'\]"):
        HuggingFaceModel(make_llama(num_hidden_layers=2), metrics={"x": object()})


def test_the_state_dict_keeps_the_class_and_config_for_exports():
    model = make_model(num_hidden_layers=2)
    state = model.state_dict()
    saved = json.loads(state["_extra_state"])
    assert saved["class"] == "LlamaForCausalLM"
    assert saved["config"]["hidden_size"] == 64 and saved["config"]["model_type"] == "llama"
    other = make_model(seed=1, num_hidden_layers=2)
    other.load_state_dict(state)  # strict: the entry loads back
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


@pytest.fixture(scope="module")
def fresh_imports():
    """What a fresh process has imported at each point: `import kiln`, then kiln.models on first use
    (kiln.models.HuggingFaceModel), then the MoE model, then its metrics. One process for both tests
    below (each python process pays the torch import, and transformers' ~2 s, again)."""
    code = (
        "import json, sys, kiln\n"
        "seen = {'import kiln': sorted({'transformers', 'kiln.models', 'torchmetrics'} & set(sys.modules))}\n"
        "seen['HuggingFaceModel'] = kiln.models.HuggingFaceModel.__name__\n"
        "from kiln.models import MoELlama, MoELlamaConfig\n"
        "seen['kiln.models'] = sorted({'torchmetrics'} & set(sys.modules))\n"
        "metrics = MoELlama(MoELlamaConfig(vocab_size=8, dim=8, num_layers=1, num_heads=2)).get_metrics()\n"
        "seen['metric'] = type(metrics['LanguagePerplexity']) is kiln.models.LanguagePerplexity\n"
        "seen['a metric made'] = sorted({'torchmetrics'} & set(sys.modules))\n"
        "print(json.dumps(seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_import_kiln_imports_no_transformers(fresh_imports):
    # kiln.models loads on first use (torchmetrics, which it needs, imports transformers when present)
    assert fresh_imports["import kiln"] == [], f"import kiln imported {fresh_imports['import kiln']}"
    assert fresh_imports["HuggingFaceModel"] == "HuggingFaceModel", fresh_imports


def test_import_kiln_models_imports_no_torchmetrics_until_a_metric_is_made(fresh_imports):
    # torchmetrics imports transformers, scipy and matplotlib when they are installed (about 2 s
    # here, more than torch): a MoE run or a dry run without evaluation never needs it (kiln.models
    # is imported here, by its first use, and a Hugging Face model named: neither imports it)
    assert fresh_imports["kiln.models"] == [], "torchmetrics imported"
    assert fresh_imports["metric"] is True, "the MoE model's perplexity is not kiln.models.LanguagePerplexity"
    assert fresh_imports["a metric made"] == ["torchmetrics"], fresh_imports


# -- the tensor-parallel plan -----------------------------------------------------------------------
def test_tp_plan_is_the_base_model_tp_plan_under_the_base_models_path():
    wrapped = make_model(num_hidden_layers=2)
    assert huggingface_tp_plan(wrapped) == {f"model.model.{k}": v for k, v in BASE_PLAN.items()}
    assert wrapped.tp_plan == huggingface_tp_plan(wrapped)  # what `kiln plan` counts as split
    # the transformers model alone: its own tp_plan attribute uses transformers' style names
    # ("colwise_gather_output", ...), which torch does not know; the base plan is used instead
    raw = make_llama(num_hidden_layers=2)
    assert model_tp_plan(raw) == {f"model.{k}": v for k, v in BASE_PLAN.items()}
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    resolved = resolve_tp_plan(wrapped, None)
    assert isinstance(resolved["model.model.layers.*.self_attn.k_proj"], ColwiseParallel)
    assert isinstance(resolved["model.model.layers.*.mlp.down_proj"], RowwiseParallel)


def test_a_kiln_tp_plan_attribute_still_wins():
    class Wrapper(nn.Module):
        tp_plan = {"inner.model.layers.*.mlp.up_proj": "colwise"}

        def __init__(self):
            super().__init__()
            self.inner = make_llama(num_hidden_layers=2)

    assert model_tp_plan(Wrapper()) == Wrapper.tp_plan


def test_tp_must_divide_the_heads_and_kv_heads():
    model = make_model(num_hidden_layers=2)  # 8 heads, 4 key/value heads
    plan = huggingface_tp_plan(model)
    check_tp_size(model, plan, 4)
    with pytest.raises(ValueError, match=r"num_key_value_heads=4, which 8 does not divide.*\[2, 4\]"):
        check_tp_size(model, plan, 8)
    with pytest.raises(ValueError, match="num_attention_heads=8, which 3 does not divide"):
        check_tp_size(model, plan, 3)
    # refused before any process group exists
    from kiln.launch.context import Context
    from kiln.parallel import TensorParallel
    from kiln.precision import get_precision

    with pytest.raises(ValueError, match="does not divide"):
        TensorParallel().setup(model, None, Context(world_size=8), get_precision("fp32"))


def test_tp_inside_pipeline_stages_takes_grouped_query_attention_with_known_styles():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = make_model(num_hidden_layers=2)  # 8 heads, 4 key/value heads
    plan = huggingface_tp_plan(model)
    check_tp_size(model, plan, 2, pipeline=True)  # colwise/rowwise: the trace is sized as one rank
    check_tp_size(model, resolve_tp_plan(model, None), 2, pipeline=True)  # torch's style objects too
    # a style whose local sizes kiln cannot tell (output sharded on dim 0) is refused, named
    odd = {**plan, "model.model.layers.*.self_attn.k_proj": ColwiseParallel(output_layouts=Shard(0))}
    with pytest.raises(ValueError, match=r"grouped-query attention.*4 key/value heads.*k_proj"):
        check_tp_size(model, odd, 2, pipeline=True)
    full = make_model(num_hidden_layers=2, num_key_value_heads=8)
    check_tp_size(full, odd, 2, pipeline=True)  # full heads: nothing is repeated, nothing to size


def test_a_transformers_style_kiln_cannot_translate_is_named():
    model = make_model(num_hidden_layers=2)
    model.model.config.base_model_tp_plan = {"layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="'packed_colwise' is a transformers style kiln does not translate"):
        resolve_tp_plan(model, None)


def test_pipeline_names_the_skip_connection_torch_cannot_run_backward(monkeypatch):
    import torch.fx.config
    from torch.distributed.pipelining import SplitPoint, pipeline

    # the per-node source stacks of the traces are for a reader of the graph (a fifth of a trace's CPU)
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", True)

    from kiln.parallel.pipelining.runtime import _skip_connection

    inputs = (make_model().pipeline_inputs(_batch()),)
    # a model is traced once (its split layers' forwards are wrapped): a fresh one for each cut
    four = pipeline(make_model(), mb_args=inputs, split_spec={p: SplitPoint.BEGINNING for p in LAYERS[1:]})
    message = _skip_connection(four)
    assert message is not None and "skip connection" in message and "stages [1, 2, 3]" in message
    # 2 stages (a 2-layer model: its trace costs half a 4-layer one's): the stage after the first
    # reads only its predecessor's outputs
    two = pipeline(make_model(num_hidden_layers=2), mb_args=inputs, split_spec={LAYERS[1]: SplitPoint.BEGINNING})
    assert _skip_connection(two) is None


# -- the config CLI ---------------------------------------------------------------------------------
def _args(model: dict):
    from kiln.config import load_trainer_args

    return load_trainer_args(
        {
            "model": model,
            "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 0.003}},
            "dataset": {"type": "hf_common.ByteWindows", "train_args": {"count": 8}},
            "micro_batch_size": 2,
            "max_train_steps": 1,
        },
        world_size=1,
    )


def test_config_builds_hugging_face_models():
    from kiln.config.trainer_builder import build_model

    small = {"model_type": "llama", **SMALL}
    model = build_model(
        _args({"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": small, "dtype": "float64"}})
    )
    assert isinstance(model, HuggingFaceModel) and next(model.parameters()).dtype == torch.float64
    assert model.model.config.num_key_value_heads == 4
    # a transformers model named directly is wrapped
    raw = {"__type": "transformers.LlamaConfig", **SMALL}
    model = build_model(_args({"type": "transformers.LlamaForCausalLM", "args": {"config": raw}}))
    assert isinstance(model, HuggingFaceModel) and isinstance(model.model, LlamaForCausalLM)


# -- strategies (one 4-rank launch) -----------------------------------------------------------------
# pp_tp_gqa: pipeline x tensor parallel over grouped-query attention (the trace sized as one rank; its
# stages mix DTensors with plain tensors, where the foreach step fails)
# (engine_zero3_tp, the Engine's loop under Hybrid(dp_shard=2, tp=2) with the model's own loss, is
# tests/test_sequence_parallel.py's llama_fsdp2_tp2, which also checks gradients and weights)
PARITY_CASES = ["ddp", "zero1", "zero3", "tp", "zero3_tp", "pp", "pp_tp_gqa"]


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_parity")
    check(fork_run(WORKERS / "hf_parity.py", str(out), *PARITY_CASES, nproc=4, timeout=400))
    return json.loads((out / "hf_parity.json").read_text())


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", PARITY_CASES)
def test_tiny_llama_gives_the_one_process_losses(parity, case):
    result = parity[case]
    assert len(result["losses"]) == 2  # hf_parity.STEPS
    assert result["max_loss_diff"] < 1e-10, result
    assert result["max_eval_diff"] < 1e-10, result
    assert result["losses"][-1] < result["losses"][0]  # it learns
    # pp x tp runs sequence parallelism inside its stages (kiln.parallel.pipelining.sequence_stages)
    assert (result["sequence_parallel_stages"] is True) == (case == "pp_tp_gqa")


# -- export (a 2-rank config CLI run) ---------------------------------------------------------------
RUN_YAML = """\
model:
  type: kiln.models.HuggingFaceModel.from_config
  args:
    config: {config}
    dtype: float64
optimizer: {{type: torch.optim.AdamW, args: {{lr: 0.003}}}}
dataset: {{type: hf_common.ByteWindows, train_args: {{count: 16}}}}
micro_batch_size: 4
max_train_steps: 2
seed: 0
enable_progress_bar: false
compute_config: {{strategy: zero3}}
checkpoint: {{save_dir: {save_dir}, every_n_train_steps: 2}}
"""


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory):
    """The folder of a `kiln train` run on 2 ranks under zero3, with its checkpoint ck/last."""
    root = tmp_path_factory.mktemp("hf_export")
    config = json.dumps({"model_type": "llama", **SMALL})
    (root / "run.yaml").write_text(RUN_YAML.format(config=config, save_dir=root / "ck"))
    check(fork_train("-f", str(root / "run.yaml"), nproc=2, timeout=300, cwd=ROOT))  # kiln train --nproc-per-node 2
    return root


def _kiln_logits(checkpoint: Path, loader) -> torch.Tensor:
    """kiln's eval logits of the checkpoint's weights: a fresh model, loaded by a Trainer, predict()."""
    model = HuggingFaceModel.from_config({"model_type": "llama", **SMALL}, dtype="float64")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003)  # the run's: its state is in the checkpoint
    trainer = kiln.Trainer(model, optimizers=optimizer, load_path=str(checkpoint), progress_bar=False)
    return torch.cat(trainer.predict(loader))


@pytest.mark.world_size(2)
def test_export_round_trip_from_a_zero3_run(zero3_run, tmp_path, capsys):
    from torch.utils.data import DataLoader

    out = tmp_path / "hf"
    assert kiln_main(["checkpoint", "export", str(zero3_run / "ck" / "last"), "--hf", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(loaded, LlamaForCausalLM) and loaded.dtype == torch.float64
    # the transformers model's own names (what any other loader of the folder expects too)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(loaded.state_dict())
    loader = DataLoader(ByteWindows(8, offset=16), batch_size=4)
    with pytest.warns(UserWarning, match="saved by 2 rank"):
        expected = _kiln_logits(zero3_run / "ck" / "last", loader)
    loaded.eval()
    with torch.no_grad():
        logits = torch.cat([loaded(input_ids=b["input_ids"]).logits for b in loader])
    assert torch.equal(logits, expected)
    # a merged checkpoint of the same run exports the same folder
    merged = tmp_path / "merged.pt"
    assert kiln_main(["checkpoint", "merge", str(zero3_run / "ck" / "last"), str(merged)]) == 0
    assert kiln_main(["checkpoint", "export", str(merged), "--hf", str(tmp_path / "hf2")]) == 0
    assert (tmp_path / "hf2" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (tmp_path / "hf2" / "config.json").read_text() == (out / "config.json").read_text()


def _plain_checkpoint(root: Path) -> tuple[Path, LlamaForCausalLM]:
    """A checkpoint of the transformers model itself (trained with criterion=): no config in it."""
    from torch.utils.data import DataLoader

    model = make_llama(num_hidden_layers=2)
    pairs = [(w["input_ids"], w["labels"]) for w in ByteWindows(4)]
    trainer = kiln.Trainer(
        model,
        criterion=lambda out, labels: F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        train_dataloader=DataLoader(pairs, batch_size=2),
        max_duration="1ba",
        save_folder=str(root / "ck"),
        save_interval="1ba",
        save_type="merged",
        progress_bar=False,
    )
    trainer.fit()
    return root / "ck" / "last", model


def test_export_without_a_config_in_the_checkpoint(tmp_path, capsys):
    checkpoint, model = _plain_checkpoint(tmp_path)
    out = tmp_path / "hf"
    assert kiln_main(["checkpoint", "export", str(checkpoint), "--hf", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no Hugging Face config" in err and "--config" in err
    assert not out.exists() and not list(tmp_path.glob("hf.tmp-*"))
    model.config.save_pretrained(tmp_path / "cfg")
    assert (
        kiln_main(["checkpoint", "export", str(checkpoint), "--hf", str(out), "--config", str(tmp_path / "cfg")]) == 0
    )
    loaded = AutoModelForCausalLM.from_pretrained(out)
    expected = model.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    # an existing OUT is never overwritten
    assert (
        kiln_main(["checkpoint", "export", str(checkpoint), "--hf", str(out), "--config", str(tmp_path / "cfg")]) == 2
    )
    assert "already exists" in capsys.readouterr().err


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    import kiln.models.hf_folder

    checkpoint, model = _plain_checkpoint(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())  # the run's: its checkpoints, its goodput account
    assert "ck" in before

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    # the export writes its safetensors files itself, one tensor at a time (kiln.models.hf_folder)
    monkeypatch.setattr(kiln.models.hf_folder, "_write_file", full_disk)
    with pytest.raises(kiln.checkpoint.CheckpointError, match="could not be written"):
        kiln.checkpoint.export_hf(checkpoint, tmp_path / "hf", config=model.config)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_export_to_an_object_store_url(tmp_path, monkeypatch):
    """--hf and --safetensors to an fsspec URL: the same bytes as a local export, config.json
    uploaded last; a failed upload leaves nothing in the bucket."""
    import uuid

    import safetensors.torch

    from kiln.checkpoint.storage import as_path

    pytest.importorskip("fsspec")
    checkpoint, model = _plain_checkpoint(tmp_path)
    model.config.save_pretrained(tmp_path / "cfg")
    bucket = f"memory://kiln-export-{uuid.uuid4().hex[:8]}"
    local = tmp_path / "hf"
    assert (
        kiln_main(["checkpoint", "export", str(checkpoint), "--hf", str(local), "--config", str(tmp_path / "cfg")]) == 0
    )
    assert (
        kiln_main(["checkpoint", "export", str(checkpoint), "--hf", f"{bucket}/hf", "--config", str(tmp_path / "cfg")])
        == 0
    )
    remote = as_path(f"{bucket}/hf")
    assert sorted(p.name for p in remote.iterdir()) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert (remote / name).read_bytes() == (local / name).read_bytes(), name
    assert kiln_main(["checkpoint", "export", str(checkpoint), "--safetensors", f"{bucket}/w.safetensors"]) == 0
    weights = safetensors.torch.load(as_path(f"{bucket}/w.safetensors").read_bytes())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items()) and len(weights) == len(
        model.state_dict()
    )

    order = []
    write = type(remote).write_bytes

    def fail_on_config(self, data):
        order.append(self.name)
        if self.name == "config.json":
            raise OSError(5, "connection reset (test)")
        return write(self, data)

    monkeypatch.setattr(type(remote), "write_bytes", fail_on_config)
    with pytest.raises(kiln.checkpoint.CheckpointError, match="hf2: could not be written .*connection reset"):
        kiln.checkpoint.export_hf(checkpoint, f"{bucket}/hf2", config=model.config)
    assert order == ["model.safetensors", "config.json"]  # the config goes last
    assert not as_path(f"{bucket}/hf2").exists()
    as_path(bucket).rmtree()
