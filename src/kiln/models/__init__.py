"""Models from other libraries behind the :class:`kiln.Model` interface.

``kiln.models.HuggingFaceModel`` wraps a Hugging Face ``transformers`` model (Composer's name).
``kiln.models.MoE`` is a mixture-of-experts feed-forward layer (:mod:`kiln.models.moe`) and
``kiln.models.MoELlama`` a small Llama-style decoder built from it (:mod:`kiln.models.moe_llama`).
transformers is an optional extra (``pip install kiln-train[hf]``): it is imported when a model is
built, never by ``import kiln`` or ``import kiln.models``.
"""

from __future__ import annotations

from typing import Any

from kiln.models.huggingface import HuggingFaceModel, is_huggingface_model
from kiln.models.moe import MoE
from kiln.models.moe_llama import MoELlama, MoELlamaConfig

__all__ = ["HuggingFaceModel", "LanguagePerplexity", "is_huggingface_model", "MoE", "MoELlama", "MoELlamaConfig"]


def __getattr__(name: str) -> Any:
    # LanguagePerplexity is a torchmetrics Metric: torchmetrics loads when it is first asked for
    # (see kiln.models.perplexity), not with ``import kiln.models``.
    if name == "LanguagePerplexity":
        from kiln.models.perplexity import LanguagePerplexity

        return LanguagePerplexity
    raise AttributeError(f"module 'kiln.models' has no attribute {name!r}")
