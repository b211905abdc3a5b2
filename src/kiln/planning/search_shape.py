"""What ``kiln plan --search`` knows of a model: :class:`ModelShape`, the sizes of a decoder-only
transformer read from its Hugging Face-style config and its parameters (meta-device parameters
count too), and which of kiln's parallel layouts its family allows.

Two rules of the strategies live here, so the memory (:mod:`kiln.planning.search_memory`) and the
collectives (:mod:`kiln.planning.search_collectives`) of a plan ask one place:
:meth:`ModelShape.sequence_parallel_at` (what ``Hybrid(tp=N)`` turns on by default: sequence
parallelism where kiln has the model's plan, inside each pipeline stage too),
:meth:`ModelShape.vocab_split_at` (the embedding and head split over the vocabulary with it, unless
they are tied: one weight cannot be row-wise and column-wise at once) and
:meth:`ModelShape.loss_parallel_at` (the loss on the logits' vocabulary shards: with the split,
not under a pipeline, whose last stage gathers the logits whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a decoder-only transformer."""

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    num_parameters: int
    layer_params: int  # one block
    tied: bool = False
    huggingface: bool = False
    deep_pipeline: bool = True  # any number of pipeline stages (a Hugging Face decoder kiln cuts: hf_stages)
    blocks: tuple[str, ...] = ()  # module names of the blocks (pipeline split points)
    sequence_parallel: bool = False  # kiln has a sequence-parallel plan for it (tp > 1 uses it)
    sequence_parallel_stages: bool = True  # ... and runs it inside pipeline stages (not a MoE family's)

    @property
    def layer_split_params(self) -> int:
        """Parameters of a block that tensor parallelism splits (attention and MLP Linears)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.ffn

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def sequence_parallel_at(self, tp: int, pp: int) -> bool:
        """Whether a plan of ``tp`` x ``pp`` runs sequence parallelism: with ``tp > 1`` where kiln has
        the model's plan, inside each pipeline stage under ``pp > 1`` (Hybrid's default) where the plan
        runs there (a MoE family's keeps plain tensor parallelism in the stages)."""
        return self.sequence_parallel and tp > 1 and (pp == 1 or self.sequence_parallel_stages)

    def vocab_split_at(self, tp: int, pp: int) -> bool:
        """Whether a plan of ``tp`` x ``pp`` splits the embedding and the head over the vocabulary:
        with sequence parallelism, unless they are tied (then both stay whole on every rank)."""
        return self.sequence_parallel_at(tp, pp) and not self.tied

    def loss_parallel_at(self, tp: int, pp: int) -> bool:
        """Whether a plan of ``tp`` x ``pp`` runs loss parallelism (the loss on the logits' vocabulary
        shards): with the vocabulary split, not under a pipeline (its last stage gathers the logits)."""
        return self.vocab_split_at(tp, pp) and pp == 1

    @classmethod
    def from_model(cls, model: nn.Module) -> ModelShape:
        """The shape of ``model`` (meta-device parameters count too): a transformer with a Hugging
        Face-style config (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ...)."""
        from kiln.parallel.transforms.parallelize import find_blocks

        config: Any = next(
            (
                getattr(m, "config")  # noqa: B009  # typed Any: a Hugging Face config, not a submodule
                for m in model.modules()
                if all(hasattr(getattr(m, "config", None), k) for k in ("num_hidden_layers", "hidden_size"))
            ),
            None,
        )
        if config is None:
            raise ValueError(
                f"kiln plan --search plans transformers: {type(model).__name__} has no Hugging Face-style config "
                "(num_hidden_layers, hidden_size, num_attention_heads, intermediate_size, vocab_size); use "
                "kiln plan without --search for its memory per strategy"
            )
        heads = int(config.num_attention_heads)
        hidden = int(config.hidden_size)
        blocks = tuple(find_blocks(model))
        num_parameters = sum(p.numel() for p in model.parameters())
        layer = sum(p.numel() for p in model.get_submodule(blocks[0]).parameters()) if blocks else 0
        return cls(
            num_layers=int(config.num_hidden_layers),
            hidden=hidden,
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            ffn=int(config.intermediate_size),
            vocab=int(config.vocab_size),
            num_parameters=num_parameters,
            layer_params=layer,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            huggingface=callable(getattr(config, "to_dict", None)),
            deep_pipeline=_cuts_into_any_stages(config),
            blocks=blocks,
            sequence_parallel=_has_sequence_parallel_plan(model),
            sequence_parallel_stages=_sequence_parallel_in_stages(model),
        )


def _cuts_into_any_stages(config: Any) -> bool:
    # a Hugging Face decoder of a family whose layers kiln makes self-contained for the pipeline's
    # trace (kiln.models.hf_stages) runs in any number of stages; any other keeps the model's rotary
    # embeddings as a skip connection from stage 0, which only 2 stages can run
    from kiln.models.hf_stages import MASK_RULES

    return not callable(getattr(config, "to_dict", None)) or getattr(config, "model_type", None) in MASK_RULES


def _has_sequence_parallel_plan(model: nn.Module) -> bool:
    # what Hybrid(tp=N) turns on by default: sequence parallelism and, with untied embeddings, loss
    # parallelism (kiln.parallel.transforms.sequence_parallel; ModelShape.tied says which);
    # kiln.models.tp_plan knows the families
    from kiln.models.tp_plan import huggingface_sequence_parallel_refusal

    return huggingface_sequence_parallel_refusal(model) is None


def _sequence_parallel_in_stages(model: nn.Module) -> bool:
    from kiln.models.tp_plan import huggingface_pipeline_sequence_parallel_refusal

    return huggingface_pipeline_sequence_parallel_refusal(model) is None
