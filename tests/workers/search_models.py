"""Models for tests/test_plan_search.py: published Llama shapes (transformers' LlamaConfig; the search
builds them on the meta device, so no weights are allocated)."""

from transformers import LlamaConfig, LlamaForCausalLM

LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
LLAMA3_70B = dict(LLAMA3_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)


def llama3_8b() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))


def llama3_70b() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**LLAMA3_70B))
