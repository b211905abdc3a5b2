"""One rank of tests/test_hf_load.py: ``HuggingFaceModel.from_pretrained`` under a strategy equals
transformers' own ``from_pretrained`` to the bit.

    python hf_load_worker.py SAVE_DIR STRATEGY [memory | MODEL,MODEL...]

SAVE_DIR holds one folder per tiny model (``llama``, ``qwen2``, ``mixtral``, ``llama_bf16``),
written by the test with ``save_pretrained(..., max_shard_size="20KB")`` (several files and an
index). For each, this rank builds a kiln Engine under STRATEGY (single, ddp, zero3, tp, pp) on
``HuggingFaceModel.from_pretrained(folder)``, gathers the whole state (parameters, persistent and
non-persistent buffers) and compares it with ``AutoModelForCausalLM.from_pretrained(folder)``:
torch.equal, same dtype. ``memory``: load ``SAVE_DIR/big`` once under the strategy and print this
rank's resident memory growth (VmHWM and RssAnon) against the model's size.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import kiln
from kiln.models import HuggingFaceModel

FOLDER, STRATEGY = Path(sys.argv[1]), sys.argv[2]
MODELS = ("llama", "qwen2", "mixtral", "llama_bf16")


def strategy(name: str, model: HuggingFaceModel):
    if name == "pp":  # two stages: the first half of the layers and the rest
        layers = model.model.config.num_hidden_layers
        return kiln.parallel.Pipeline([f"model.model.layers.{layers // 2}"], example_input=EXAMPLE, microbatches=2)
    if name == "tp":
        if model.model.config.model_type == "mixtral":  # kiln does not translate its packed experts' style
            attention = "model.model.layers.*.self_attn"
            plan = {f"{attention}.{p}_proj": "colwise" for p in "qkv"} | {f"{attention}.o_proj": "rowwise"}
            return kiln.parallel.TensorParallel(plan=plan)
        return kiln.parallel.TensorParallel()
    return name


EXAMPLE = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}


def full_state(engine: kiln.Engine) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) of the model, whole, by name."""
    from torch.distributed.tensor import DTensor

    module = engine.strategy.unwrap(engine.model)
    found: dict[str, torch.Tensor] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    if STRATEGY == "pp":  # each stage's tensors, gathered whole by the pipeline's own state dict
        from kiln.parallel.pipelining.runtime import full_pipeline_state_dict

        state = full_pipeline_state_dict(engine.model)
        return {k.removeprefix("model."): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for name, value in named:
        value = value.full_tensor() if isinstance(value, DTensor) else value
        found[name.removeprefix("model.")] = value.detach().cpu()
    return found


def compare(name: str) -> None:
    folder = FOLDER / name
    model = HuggingFaceModel.from_pretrained(str(folder))
    assert all(p.is_meta for p in model.parameters()), "from_pretrained must build on the meta device"
    engine = kiln.Engine(model, strategy=strategy(STRATEGY, model))
    got = full_state(engine)
    want_model = AutoModelForCausalLM.from_pretrained(str(folder))
    want = {n: t for n, t in [*want_model.named_parameters(remove_duplicate=False), *want_model.named_buffers()]}
    if STRATEGY == "pp":  # the stages hold the persistent state only
        want = {k: v for k, v in want_model.state_dict().items()}
    missing = sorted(set(want) - set(got))
    assert not missing, f"{name}: not in the loaded model: {missing}"
    for key, value in want.items():
        assert got[key].dtype == value.dtype, f"{name}: {key} is {got[key].dtype}, transformers {value.dtype}"
        assert torch.equal(got[key], value), f"{name}: {key} differs from transformers' from_pretrained"
    print(f"OK {name} {STRATEGY} {len(want)} tensors", flush=True)


def rss() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def memory() -> None:
    # a first load of a tiny model of the same class imports and allocates what any load does
    kiln.Engine(HuggingFaceModel.from_pretrained(str(FOLDER / "warm")), strategy=STRATEGY)
    folder = FOLDER / "big"
    model = HuggingFaceModel.from_pretrained(str(folder))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = rss()
    engine = kiln.Engine(model, strategy=STRATEGY)
    after = rss()
    local = sum(
        p.to_local().numel() * p.element_size() if hasattr(p, "to_local") else p.numel() * p.element_size()
        for p in engine.model.parameters()
    )
    report = {
        "rank": kiln.context().rank,
        "model_bytes": size,
        "local_bytes": local,
        "hwm_growth": after["VmHWM"] - before["VmRSS"],
        "anon_growth": after["RssAnon"] - before["RssAnon"],
    }
    print("MEMORY " + json.dumps(report), flush=True)


def main() -> None:
    kiln.launch_from_torch(seed=0)
    if len(sys.argv) > 3 and sys.argv[3] == "memory":
        memory()
        return
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else MODELS
    for name in names:
        if (FOLDER / name).is_dir():
            compare(name)


if __name__ == "__main__":
    main()
