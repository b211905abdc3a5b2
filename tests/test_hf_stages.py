"""A Hugging Face decoder cut into any number of pipeline stages (kiln.models.hf_stages).

In this process: torch.distributed.pipelining traces a decoder of each way transformers picks a
layer's mask (Llama: causal; Qwen2 with sliding layers: per layer type; Mixtral, as Mistral: one
sliding window) into 4 stages with ``HuggingFaceModel.pipeline_trace`` entered,
and the cut model (its stages run one after another by the split graph) must give the logits of
the model itself, bit for bit, with nothing but the hidden states crossing a stage boundary. The
multi-process runs (4 stages 1F1B, 8 stages interleaved, on 4 ranks, against one process) are in
tests/test_sequence_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx.config

pytest.importorskip("transformers")

from torch.distributed.pipelining import SplitPoint, pipeline  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from kiln.models import HuggingFaceModel  # noqa: E402
from kiln.parallel.pipelining.runtime import _keep_unsaved, _non_persistent_buffers, _skip_connection  # noqa: E402

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
SEQ = 16
FAMILIES = {
    "llama": ("llama", {}),
    # layers 2 and 3 attend through a window of 4 (seq 16): the layers' masks differ
    "qwen2_sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}),
    # 2 experts, top 1: the trace runs each expert's branch (its cost grows with their number); the
    # family is here for its mask (Mistral's one sliding window)
    "mixtral": ("mixtral", {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 4}),
}


def _model(family: str, **fields) -> HuggingFaceModel:
    model_type, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**COMMON, **extra, **fields}))
    # float64 where transformers' kernels take it (its grouped experts run float32 only)
    return HuggingFaceModel(model.to(torch.float32 if model_type == "mixtral" else torch.float64))


def _cut(model: HuggingFaceModel, batch: dict):
    """4 stages, traced with the model's preparation; and the model's unsaved buffers seen in the trace."""
    split = {f"model.model.layers.{i}": SplitPoint.BEGINNING for i in (1, 2, 3)}
    with model.pipeline_trace(batch):
        unsaved = _non_persistent_buffers(model)
        return pipeline(model, mb_args=(batch,), split_spec=split), unsaved


@pytest.fixture(scope="module", autouse=True)
def _no_stack_traces():
    # the per-node source stacks of the traces are for a reader of the graph (a fifth of a trace's
    # CPU, and every test here traces); nothing here reads them
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.fx.config, "do_not_emit_stack_traces", True)
        yield


@pytest.fixture(scope="module")
def cut():
    """family -> (model, batch, its 4 stages, the unsaved buffers): each traced once (a trace costs
    seconds), for the logits test and, the Llama, the state-dict test."""
    made = {}

    def get(family: str):
        if family not in made:
            model = _model(family)
            gen = torch.Generator().manual_seed(1)
            batch = {"input_ids": torch.randint(0, COMMON["vocab_size"], (2, SEQ), generator=gen)}
            made[family] = (model, batch, *_cut(model, batch))
        return made[family]

    return get


def _stage_inputs(pipe) -> list[int]:
    """How many values each stage after the first receives."""
    graph = pipe.split_gm.graph
    return [len(n.args) + len(n.kwargs) for n in graph.nodes if n.op == "call_module"][1:]


@pytest.mark.parametrize("family", FAMILIES)
def test_four_stages_pass_only_the_hidden_states_and_give_the_model_s_logits(cut, family):
    model, batch, pipe, _ = cut(family)
    want = model(batch).logits
    assert pipe.num_stages == 4 and _skip_connection(pipe) is None
    assert _stage_inputs(pipe) == [1, 1, 1]  # the hidden states, nothing else
    got = pipe(batch)
    assert torch.equal(got[0] if isinstance(got, (tuple, list)) else got, want)
    # the trace left the model as it was: no per-layer rotary copy, the layers' own forward
    assert not any(".rotary_emb." in name for name, _ in model.named_buffers() if ".layers." in name)
    assert all("forward" not in vars(layer) for layer in model.model.model.layers)


def test_without_the_model_s_preparation_later_stages_get_skip_connections():
    # the "before": the rotary pair, the positions and the mask go from stage 0 to every later stage
    # (3 layers, 3 stages: stage 2 reads stage 0's outputs; the trace costs 3/4 of 4 layers')
    model = _model("llama", num_hidden_layers=3)
    batch = {"input_ids": torch.zeros(2, SEQ, dtype=torch.long)}
    split = {f"model.model.layers.{i}": SplitPoint.BEGINNING for i in (1, 2)}
    pipe = pipeline(model, mb_args=(batch,), split_spec=split)
    assert "skip connection" in (_skip_connection(pipe) or "")


def test_the_stages_state_dicts_hold_the_model_s_keys_and_no_rotary_copy(cut):
    # the trace registers every buffer as persistent; the runtime marks the model's unsaved ones
    # (the stages are fresh modules of the split graph: marking them leaves the model as it was)
    model, _, pipe, unsaved = cut("llama")
    assert {"model.model.layers.3.rotary_emb.inv_freq", "model.model.rotary_emb.inv_freq"} <= unsaved
    keys = set()
    for i in range(pipe.num_stages):
        stage = pipe.split_gm.get_submodule(f"submod_pp_{i}")
        _keep_unsaved(stage, unsaved)
        keys |= set(stage.state_dict())
    assert keys == set(model.state_dict()) - {"_extra_state"}  # the wrapper's config entry: not a stage's
