"""Models from other libraries behind the :class:`kiln.Model` interface.

``kiln.models.HuggingFaceModel`` wraps a Hugging Face ``transformers`` model (Composer's name).
transformers is an optional extra (``pip install kiln-train[hf]``): it is imported when a model is
built, never by ``import kiln`` or ``import kiln.models``.
"""

from __future__ import annotations

from kiln.models.huggingface import HuggingFaceModel, LanguagePerplexity, is_huggingface_model

__all__ = ["HuggingFaceModel", "LanguagePerplexity", "is_huggingface_model"]
