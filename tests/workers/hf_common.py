"""The tiny Llama and the text every Hugging Face test trains: float64, byte-level tokens.

The text is the source of a Python standard-library module (``inspect.getsource``), the same on
every machine; the tokens are its bytes (vocabulary 256), cut into windows of ``SEQ`` bytes. A
batch is ``{"input_ids": (N, SEQ), "labels": (N, SEQ)}``: transformers shifts the labels itself.
Importing this module imports transformers (tests skip first when it is missing).
"""

from __future__ import annotations

import inspect
import textwrap

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

SEQ = 16
# 8 query heads, 4 key/value heads (grouped-query attention): tensor parallelism over 4 ranks
# gives each rank 2 query heads and 1 key/value head. 4 layers: a pipeline stage per rank.
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
)
LAYERS = [f"model.model.layers.{i}" for i in range(CONFIG["num_hidden_layers"])]  # in a HuggingFaceModel


def make_llama(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return exact(LlamaForCausalLM(LlamaConfig(**{**CONFIG, **overrides})).to(dtype))


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides):
    from kiln.models import HuggingFaceModel

    return HuggingFaceModel(make_llama(seed, dtype, **overrides))


class ExactRMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm in the input's dtype (at least float32) instead of always float32."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(torch.promote_types(hidden_states.dtype, torch.float32))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(hidden_states.dtype)


def exact_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """transformers' ForCausalLMLoss (labels shifted left, mean over counted tokens) without its float32 cast."""
    labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(
        logits.reshape(-1, vocab_size), labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
    )
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


def exact(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` computing in its own dtype throughout, in place.

    transformers computes RMSNorm and the causal-LM loss in float32 whatever the model's dtype
    (``.to(torch.float32)``, ``logits.float()``), so a float64 Llama still rounds to float32 there
    and the 1e-16 differences of another summation order grow to 1e-7. These two replacements do
    the same arithmetic in float64 (and in float32 for a float32 model, as before).
    """
    for module in model.modules():
        if type(module) is LlamaRMSNorm:
            module.__class__ = ExactRMSNorm
    model.loss_function = exact_causal_lm_loss
    return model


def text_tokens() -> torch.Tensor:
    """The bytes of ``textwrap``'s source as token ids."""
    return torch.tensor(list(inspect.getsource(textwrap).encode()), dtype=torch.long)


class ByteWindows(torch.utils.data.Dataset):
    """``count`` consecutive windows of ``seq`` byte tokens, starting ``offset`` windows in."""

    def __init__(self, count: int, offset: int = 0, seq: int = SEQ) -> None:
        tokens = text_tokens()
        self.windows = tokens[offset * seq : (offset + count) * seq].view(count, seq)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.windows[index]
        return {"input_ids": window, "labels": window.clone()}


def batches(steps: int, global_batch: int, offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """``steps`` global batches of :class:`ByteWindows`, in order."""
    windows = ByteWindows(steps * global_batch, offset).windows
    return [{"input_ids": w, "labels": w.clone()} for w in windows.split(global_batch)]
