"""A Hugging Face decoder cut into any number of pipeline stages.

transformers' decoders (Llama, Mistral, Qwen2/3, Mixtral, Qwen-MoE, ...) compute three things once,
before the first layer, and hand the same objects to every layer: the rotary position embeddings
``(cos, sin)``, the ``position_ids`` and the causal mask. Traced into pipeline stages, each is a
value that stage 0 sends to every later stage (a skip connection). torch.distributed.pipelining
cannot run the backward of a floating-point one (the rotary pair), and its multi-stage schedules
(interleaved 1F1B, the zero-bubble ones) refuse any, which limited these models to 2 stages.

:func:`self_contained_layers` is entered around the pipeline's trace (the runtime asks the model
for it through ``HuggingFaceModel.pipeline_trace``): each decoder layer gets its own copy of the
rotary module (``layers.N.rotary_emb``, a non-persistent buffer of ``head_dim / 2`` frequencies,
so checkpoints and exports never see it) and computes ``(cos, sin)`` from its positions; when the
batch gives no ``attention_mask`` and no ``position_ids`` (causal-LM training on full windows), it
also computes the positions (``0 .. seq - 1``) and the causal mask itself, with the same
transformers function the model calls for that layer (a sliding window where the model uses one).
The values are the model's own to the bit (the same functions on the same inputs); what crosses a
stage boundary is then the hidden states alone, for any number of stages and every schedule.
torchtitan's Llama does the same: each stage computes its rotary frequencies and causal attention.
A batch with an ``attention_mask`` or ``position_ids`` keeps the model's own (integer skip
connections, which only the single-stage schedules run; torch.export cannot trace transformers'
padding masks today, with or without kiln, so pipelines train on full windows, as torchtitan's do).
The layers are restored when the trace ends; the traced stages keep their copies.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["MASK_RULES", "decoder_parts", "self_contained_layers"]

ROTARY = "rotary_emb"  # the submodule name each layer gets for the trace (transformers' own name)

# How each model family picks a layer's mask (its modeling file's forward): from
# ``config.layer_types[i]`` ("layer_types"), or one function for every layer, the sliding-window one
# when ``config.sliding_window`` is set ("sliding_window"), or the plain causal mask ("causal").
# A family not listed keeps the model's own mask and positions (skip connections).
MASK_RULES = {
    "llama": "causal",
    "mistral": "sliding_window",
    "mixtral": "sliding_window",
    "qwen3_moe": "sliding_window",
    "qwen2": "layer_types",
    "qwen3": "layer_types",
    "qwen2_moe": "layer_types",
}


def decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList] | None:
    """The rotary module and the decoder layers of a transformers decoder whose layers take
    ``position_embeddings`` (the base model at ``model.model`` or the model itself); None otherwise."""
    for base in (getattr(model, "model", None), model):
        rotary, layers = getattr(base, ROTARY, None), getattr(base, "layers", None)
        if isinstance(rotary, nn.Module) and isinstance(layers, nn.ModuleList) and len(layers):
            if "position_embeddings" in inspect.signature(layers[0].forward).parameters:
                return rotary, layers
    return None


@contextmanager
def self_contained_layers(model: nn.Module, batch: Mapping[str, Any] | None = None) -> Iterator[None]:
    """While tracing: every decoder layer of ``model`` computes its own rotary embeddings, and, for a
    ``batch`` without ``attention_mask`` and ``position_ids``, its own positions and causal mask (see
    the module docstring). Does nothing to a model without such layers."""
    parts = decoder_parts(model)
    if parts is None:
        yield
        return
    rotary, layers = parts
    config = getattr(model, "config", None)
    given = set(batch) if isinstance(batch, Mapping) else {"attention_mask"}  # unknown: keep the model's
    rule = MASK_RULES.get(getattr(config, "model_type", ""))
    own_mask = rule is not None and not given & {"attention_mask", "position_ids"}
    for index, layer in enumerate(layers):
        layer.add_module(ROTARY, _own_copy(rotary))
        mask = _mask_function(config, rule, index) if own_mask else None
        layer.forward = _own_inputs(layer, layer.forward, config, mask)  # an instance attribute: one layer only
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
            delattr(layer, ROTARY)


def _own_copy(rotary: nn.Module) -> nn.Module:
    # A module of its own (a traced stage keeps only the modules its layers call) over clones of
    # the buffers. Not copy.deepcopy: in a dry run the buffers are fake tensors, whose deep copies
    # share what the fake mode tracks and crashed the interpreter at exit (a double free).
    own = copy.copy(rotary)
    own._parameters = dict(rotary._parameters)
    own._buffers = {name: None if b is None else b.clone() for name, b in rotary._buffers.items()}
    own._non_persistent_buffers_set = set(rotary._non_persistent_buffers_set)
    own._modules = dict(rotary._modules)
    return own


def _mask_function(config: Any, rule: str | None, index: int) -> Callable[..., Any]:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    if rule == "layer_types":
        sliding = config.layer_types[index] == "sliding_attention"
    else:
        sliding = rule == "sliding_window" and getattr(config, "sliding_window", None) is not None
    return create_sliding_window_causal_mask if sliding else create_causal_mask


def _no_cache(mask: Callable[..., Any], positions: torch.Tensor) -> dict[str, Any]:
    # transformers 5 names the cache ``cache``; 4.x names it ``past_key_values`` and also takes the
    # positions as ``cache_position``
    names = inspect.signature(mask).parameters
    return {"cache": None} if "cache" in names else {"past_key_values": None, "cache_position": positions}


def _own_inputs(layer: nn.Module, forward: Any, config: Any, mask: Callable[..., Any] | None) -> Any:
    def self_contained(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # The mask and the rotary pair read only the hidden states' shape, dtype and device: they get
        # a tensor of that shape made anew, so in the traced graph they do not hang on the hidden
        # states (under sequence parallelism those arrive as a sequence-sharded DTensor, and the
        # plain mask and rotary pair must stay plain: kiln.parallel.pipelining.sequence_stages).
        shape = torch.zeros(hidden_states.shape[:2] + (1,), dtype=hidden_states.dtype, device=hidden_states.device)
        if mask is not None:  # what the model computes before its first layer, for a batch without them
            positions = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
            kwargs["position_ids"] = positions
            kwargs["attention_mask"] = mask(
                config=config, inputs_embeds=shape, attention_mask=None, position_ids=positions,
                **_no_cache(mask, positions[0]),
            )  # fmt: skip
        kwargs["position_embeddings"] = getattr(layer, ROTARY)(shape, position_ids=kwargs.get("position_ids"))
        return forward(hidden_states, *args, **kwargs)

    return self_contained
