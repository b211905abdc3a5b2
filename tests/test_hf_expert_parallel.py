"""Expert parallelism of transformers' fused MoE blocks (kiln.parallel.transforms.hf_expert_parallel).

workers/hf_ep_worker.py trains a tiny transformers Mixtral and Qwen2-MoE (2 layers, hidden 16,
4 experts, top 2) in float64 under ``Hybrid(dp_shard=2, ep=2)`` on 2 processes (each rank holds 2
experts of every layer, routes its own half of each microbatch with the model's own router and
sends the rows to the experts' rank), with plain SGD, 2 microbatches per step and clipping below
every step's norm, against one process on the whole batch: every microbatch's loss, every step's
gradient norm and every weight after 3 steps within TOL. The Qwen2-MoE adds its shared expert and
gate (replicated, FSDP-sharded as any dense weight) and un-renormalised top-k weights.

Margin, measured (torch 2.13, transformers 5.24, CPU, gloo): losses within 8.9e-16, gradient
norms 2.2e-16, weights 6.9e-18 (Qwen3-MoE, run by hand with the worker: 1.4e-17). By hand on 4
ranks, ``Hybrid(dp_shard=4, ep=2)`` (the experts FSDP-sharded over efsdp 2): Mixtral, Qwen2-MoE and
Qwen3-MoE within 1.8e-15, 3.3e-16 and 1.4e-17 (not in the suite: a 4-rank launch, ~60 CPU-s). The loss is the
worker's own float64 cross-entropy: transformers' casts the logits to float32, whose mean over a
batch and over its two halves differ by ~5e-7.

Broken on purpose in the same launch: the experts' ``1 / ep`` gradient scale dropped
(``mixtral_unscaled``): the expert gradients double, and the test asserts it fails the same check.
"""

from __future__ import annotations

import json

import pytest
import torch

from distributed import WORKERS, check, fork_run

pytest.importorskip("transformers")

TOL = 1e-9
CASES = ("mixtral", "qwen2_moe", "mixtral_unscaled")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_ep")
    check(fork_run(WORKERS / "hf_ep_worker.py", str(out), *CASES, nproc=2, timeout=300))
    return json.loads((out / "hf_ep.json").read_text())


def _failures(r: dict) -> list[str]:
    found = []
    loss = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"]))
    norm = max(abs(a - b) for a, b in zip(r["norms"], r["ref_norms"]))
    if loss >= TOL:
        found.append(f"losses differ by {loss:.3g}")
    if norm >= TOL:
        found.append(f"gradient norms differ by {norm:.3g}")
    if r["weight_diff"] >= TOL:
        found.append(f"weights differ by {r['weight_diff']:.3g} ({r['worst_weight']})")
    return found


@pytest.mark.world_size(2)
@pytest.mark.parametrize("model", ["mixtral", "qwen2_moe"])
def test_expert_parallel_transformers_moe_equals_one_process(results, model):
    r = results[model]
    assert len(r["losses"]) == 6 and len(r["norms"]) == 3  # 3 steps of 2 microbatches
    assert not _failures(r), f"{model}: {'; '.join(_failures(r))}"
    assert min(r["ref_norms"]) > 2 * 0.05, r["ref_norms"]  # every step clipped
    assert r["moved"] > 1e-3  # the weights trained
    # each rank holds 2 of the 4 experts of each of the 2 layers, on the ep mesh (FSDP's efsdp too)
    assert r["local_experts"] == 2 and r["layers"] == 2 and "ep" in r["mesh"], r


@pytest.mark.world_size(2)
def test_experts_without_the_one_over_ep_scale_fail(results):
    # measured: losses off by 1.3e-6 (from the second step), gradient norms by 5.1e-4, weights by
    # 5.4e-5, the worst an expert's gate_up_proj (clipping at 0.05 keeps every step small)
    r = results["mixtral_unscaled"]
    failures = _failures(r)
    assert len(failures) == 3, failures  # losses, norms and weights all off
    assert r["weight_diff"] > 1e4 * TOL and ".experts." in r["worst_weight"], r


def test_check_expert_parallel_finds_transformers_fused_experts():
    """Mixtral, Qwen2-MoE and Qwen3-MoE share transformers' fused experts: ``ep`` is checked
    against their expert count in one line, before any process group; a model with neither kiln's
    MoE layers nor fused experts is refused as before."""
    import transformers

    from kiln.models import HuggingFaceModel
    from kiln.parallel.transforms.expert_parallel import check_expert_parallel
    from kiln.parallel.transforms.hf_expert_parallel import fused_experts

    common = dict(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    configs = {
        "MixtralExperts": (transformers.MixtralConfig, {"num_local_experts": 6}),
        "Qwen2MoeExperts": (transformers.Qwen2MoeConfig, {"num_experts": 6, "moe_intermediate_size": 8}),
        "Qwen3MoeExperts": (transformers.Qwen3MoeConfig, {"num_experts": 6, "moe_intermediate_size": 8}),
    }
    for name, (config_class, experts) in configs.items():
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config_class(**common, **experts))
        found = [(n, type(m).__name__) for n, m in fused_experts(model)]
        assert found == [("model.layers.0.mlp.experts", name)], found
        check_expert_parallel(HuggingFaceModel(model), 3)
        with pytest.raises(ValueError) as err:
            check_expert_parallel(HuggingFaceModel(model), 4)
        assert str(err.value) == (
            f"ep=4 does not divide num_experts=6 of {name} 'model.model.layers.0.mlp.experts' (each rank holds "
            "num_experts / ep whole experts); use an ep in [1, 2, 3, 6]"
        )
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with pytest.raises(ValueError, match=r"^ep=2 splits the experts .* and LlamaForCausalLM has none, nor"):
        check_expert_parallel(HuggingFaceModel(llama), 2)
