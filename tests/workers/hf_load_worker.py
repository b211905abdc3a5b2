"""One rank of tests/test_hf_load.py: ``HuggingFaceModel.from_pretrained`` under a strategy equals
transformers' own ``from_pretrained`` to the bit.

    python hf_load_worker.py SAVE_DIR CASE [CASE ...]

A CASE is ``STRATEGY`` (every model) or ``STRATEGY:MODEL+MODEL``; the cases of one launch run one
after the other in the same ranks (a launch costs more than a tiny model's load). SAVE_DIR holds
one folder per tiny model (``llama``, ``qwen2``, ``mixtral``, ``llama_bf16``), written by the test
with ``save_pretrained(..., max_shard_size="20KB")`` (several files and an index). For each, this
rank builds a kiln Engine under STRATEGY on ``HuggingFaceModel.from_pretrained(folder)``, gathers
the whole state (parameters, persistent and non-persistent buffers) and compares it with
``AutoModelForCausalLM.from_pretrained(folder)``: torch.equal, same dtype. STRATEGY is one of:

* ``single``, ``ddp``, ``zero3``: kiln's strategy of that name;
* ``tp``: ``TensorParallel()``, ``hybrid``: ``Hybrid(dp_shard=2, tp=2)`` (4 ranks); both with
  kiln's default sequence and loss parallel plans (checked: the norms are DTensors on the ``tp``
  mesh, and an untied LM head is split over the vocabulary there), the Mixtral's fused experts
  split by kiln's ``fused_experts_partial`` style (checked: the experts' ``gate_up_proj`` is a
  DTensor on the ``tp`` mesh);
* ``ep``: ``Hybrid(dp_shard=2, ep=2)`` (the Mixtral): its fused experts split over ``ep``
  (kiln.parallel.transforms.hf_expert_parallel; checked: a DTensor on the ``ep`` mesh, 2 of the 4
  experts on each rank), and this rank read from the files the per-expert tensors of its own
  experts, each whole, and no other expert's: ``OK ... experts 0,1`` (rank 0) / ``2,3``;
* ``pp``: a 2-stage pipeline; ``pp_fsdp``/``pp_tp``: ``Hybrid(pp=2, dp_shard=2)`` / ``Hybrid(pp=2,
  tp=2)`` (4 ranks). Under each, this rank must have read from the files exactly the bytes of its
  own stage's tensors (its shards of them), counted at kiln's one reader (``SafetensorsFile.read``),
  and less than the whole model: ``OK ... read N of TOTAL bytes``;
* ``memory``: load ``SAVE_DIR/big`` once under zero3 and print this rank's resident memory growth
  (VmHWM and RssAnon) against the model's size.
"""

from __future__ import annotations

import functools
import gc
import json
import re
import sys
from pathlib import Path

import torch
import torch.fx.config
from transformers import AutoModelForCausalLM

import kiln
from kiln.models import HuggingFaceModel

FOLDER = Path(sys.argv[1])
MODELS = ("llama", "qwen2", "mixtral", "llama_bf16")
EXAMPLE = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}


def strategy(name: str, model: HuggingFaceModel):
    if name == "pp":  # two stages: the first half of the layers and the rest
        layers = model.model.config.num_hidden_layers
        return kiln.parallel.Pipeline([f"model.model.layers.{layers // 2}"], example_input=EXAMPLE, microbatches=2)
    if name in ("pp_fsdp", "pp_tp"):  # two stages, each sharded over 2 ranks
        layers = model.model.config.num_hidden_layers
        inner = {"dp_shard": 2} if name == "pp_fsdp" else {"tp": 2}
        return kiln.parallel.Hybrid(
            pp=2, **inner, split_points=[f"model.model.layers.{layers // 2}"], example_input=EXAMPLE, microbatches=2
        )
    if name == "tp":
        return kiln.parallel.TensorParallel()
    if name == "hybrid":
        return kiln.parallel.Hybrid(dp_shard=2, tp=2)
    if name == "ep":
        return kiln.parallel.Hybrid(dp_shard=2, ep=2)
    return name


def full_state(engine: kiln.Engine, name: str) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too) of the model, whole, by name."""
    from torch.distributed.tensor import DTensor

    if name.startswith("pp"):  # each stage's tensors, gathered whole by the pipeline's own state dict
        from kiln.parallel.pipelining.runtime import full_pipeline_state_dict

        state = full_pipeline_state_dict(engine.model)
        return {k.removeprefix("model."): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    module = engine.strategy.unwrap(engine.model)
    found: dict[str, torch.Tensor] = {}
    for key, value in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        value = value.full_tensor() if isinstance(value, DTensor) else value
        found[key.removeprefix("model.")] = value.detach().cpu()
    return found


def on_tp(tensor: torch.Tensor, shard: int | None) -> bool:
    """Whether ``tensor`` is a DTensor on a mesh with a ``tp`` dimension, sharded there on
    dimension ``shard`` (None: any placement)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor) or "tp" not in (tensor.device_mesh.mesh_dim_names or ()):
        return False
    placement = tensor.placements[tensor.device_mesh.mesh_dim_names.index("tp")]
    return shard is None or (isinstance(placement, Shard) and placement.dim == shard)


def check_sequence_parallel(engine: kiln.Engine, model: str) -> None:
    """Every model ran kiln's default sequence (and, untied, loss) parallel plan; the Mixtral's fused
    experts are split over tp too (gate and up alike)."""
    hf = engine.strategy.unwrap(engine.model).model
    if model == "mixtral":
        assert on_tp(hf.model.layers[0].mlp.experts.gate_up_proj, None), "mixtral: experts not split"
    assert on_tp(hf.model.layers[0].input_layernorm.weight, None), f"{model}: no sequence parallelism"
    tied = bool(hf.config.tie_word_embeddings)
    assert on_tp(hf.lm_head.weight, 0) != tied, f"{model}: loss parallel is {'on' if tied else 'off'}"


def shared_names(module: torch.nn.Module, prefix: str = "") -> list[list[str]]:
    """The names (``prefix`` dropped) of each parameter that several modules hold: one object."""
    names: dict[int, list[str]] = {}
    for key, value in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(value), []).append(key.removeprefix(prefix))
    return sorted(group for group in names.values() if len(group) > 1)


@functools.cache
def transformers_model(name: str):
    """transformers' own from_pretrained of the model: the same for every case of a launch, read once."""
    return AutoModelForCausalLM.from_pretrained(str(FOLDER / name))


READ: list[int] = []  # bytes this rank read from the safetensors files, one entry per read
READ_KEYS: dict[str, int] = {}  # the same bytes by file tensor


def count_reads() -> None:
    """Count every read kiln's loader makes from the files (SafetensorsFile.read is its one reader)."""
    from kiln.models import hf_weights

    read = hf_weights.SafetensorsFile.read

    def counted(self, key, box=None):
        value = read(self, key, box)
        READ.append(value.numel() * value.element_size())
        READ_KEYS[key] = READ_KEYS.get(key, 0) + READ[-1]
        return value

    hf_weights.SafetensorsFile.read = counted


def file_bytes(folder: Path) -> dict[str, int]:
    """Each tensor's bytes in the files, by key."""
    from kiln.models.hf_weights import SafetensorsFile, checkpoint_keys

    sizes = {}
    for path in sorted(set(checkpoint_keys(folder).values())):
        file = SafetensorsFile(path)
        sizes.update({key: entry["data_offsets"][1] - entry["data_offsets"][0] for key, entry in file.entries.items()})
        file.close()
    return sizes


def stage_reads(engine: kiln.Engine, folder: Path, read: int) -> str:
    """Under a pipeline: this rank read the bytes of its own stage's weights from the files (with
    FSDP or tensor parallelism in the stage, of its shards), each once, and no more (a tied head in
    the last stage reads the embedding it is tied to)."""
    sizes = file_bytes(folder)
    tied = dict(engine.strategy.pipeline.model.model.all_tied_weights_keys or {})
    held: dict[int, tuple[str, torch.Tensor]] = {}  # each tensor this rank holds, by one of its names
    for key, value in engine.model.state_dict(keep_vars=True).items():
        held.setdefault(id(value), (key.removeprefix("model."), value))
    want = 0
    for key, value in held.values():
        local = value.to_local() if hasattr(value, "to_local") else value
        want += sizes[tied.get(key, key)] * local.numel() // value.numel()
    total = sum(sizes.values())
    assert read == want, f"{folder.name}: this rank read {read} bytes; its stage's weights are {want} bytes"
    assert read < total, f"{folder.name}: this rank read {read} bytes, the whole model is {total}"
    return f"read {read} of {total} bytes"


def expert_reads(engine: kiln.Engine, folder: Path) -> str:
    """Under ep: the experts are split over the ``ep`` mesh, and this rank read the files' tensors
    of its own experts (``...experts.<j>.w1/w2/w3``), each whole, and no other expert's."""
    experts = engine.strategy.unwrap(engine.model).model.model.layers[0].mlp.experts
    weight = experts.gate_up_proj
    names = weight.device_mesh.mesh_dim_names or ()
    assert "ep" in names and weight.to_local().shape[0] == 2, (names, weight.to_local().shape)
    rank = weight.device_mesh.get_local_rank("ep")
    sizes = file_bytes(folder)
    index = {key: int(m.group(1)) for key in sizes if (m := re.search(r"\.experts\.(\d+)\.", key))}
    read = {key for key in READ_KEYS if key in index}
    mine = {key for key, j in index.items() if j // 2 == rank}
    assert read == mine, f"{folder.name}: read experts {sorted(read)}, this rank holds {sorted(mine)}"
    assert all(READ_KEYS[key] == sizes[key] for key in mine), "an expert's tensor was not read whole"
    return "experts " + ",".join(str(j) for j in sorted({index[key] for key in read}))


def compare(name: str, case: str) -> None:
    folder = FOLDER / name
    model = HuggingFaceModel.from_pretrained(str(folder))
    assert all(p.is_meta for p in model.parameters()), "from_pretrained must build on the meta device"
    READ.clear()
    READ_KEYS.clear()
    engine = kiln.Engine(model, strategy=strategy(case, model))
    read = sum(READ)
    if case in ("tp", "hybrid"):
        check_sequence_parallel(engine, name)
    got = full_state(engine, case)
    want_model = transformers_model(name)
    if not case.startswith("pp"):  # tied weights stay one parameter (the stages of a pipeline are traced copies)
        ties = shared_names(engine.strategy.unwrap(engine.model), prefix="model.")
        assert ties == shared_names(want_model), f"{name}: tied {ties}, transformers {shared_names(want_model)}"
    want = {n: t for n, t in [*want_model.named_parameters(remove_duplicate=False), *want_model.named_buffers()]}
    if case.startswith("pp"):  # the stages hold the persistent state only
        want = {k: v for k, v in want_model.state_dict().items()}
    missing = sorted(set(want) - set(got))
    assert not missing, f"{name}: not in the loaded model: {missing}"
    for key, value in want.items():
        assert got[key].dtype == value.dtype, f"{name}: {key} is {got[key].dtype}, transformers {value.dtype}"
        assert torch.equal(got[key], value), f"{name}: {key} differs from transformers' from_pretrained"
    reads = stage_reads(engine, folder, read) if case.startswith("pp") else ""
    if case == "ep":
        reads = expert_reads(engine, folder)
    print(f"OK {name} {case} {len(want)} tensors {reads}".rstrip(), flush=True)


def rss() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def memory() -> None:
    # a first load of a tiny model of the same class imports and allocates what any load does
    kiln.Engine(HuggingFaceModel.from_pretrained(str(FOLDER / "warm")), strategy="zero3")
    folder = FOLDER / "big"
    model = HuggingFaceModel.from_pretrained(str(folder))
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = rss()
    engine = kiln.Engine(model, strategy="zero3")
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
    # the source stack fx records for each traced node, and prints into each stage's code, is for a
    # reader of the graph, which nothing here is: without it a pipeline's trace costs less CPU
    torch.fx.config.do_not_emit_stack_traces = True
    count_reads()
    for case in sys.argv[2:]:
        name, _, models = case.partition(":")
        if name == "memory":
            memory()
            continue
        for model in models.split("+") if models else MODELS:
            compare(model, name)


if __name__ == "__main__":
    main()
