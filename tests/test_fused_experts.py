"""transformers' fused MoE experts under tensor parallelism (kiln.parallel.transforms.fused_experts).

workers/fused_experts_worker.py trains a tiny Mixtral (4 experts, top 2, intermediate 48) in float64
under ``TensorParallel()`` on 2 processes, the model's own plan (attention column/row-wise, the
experts' ``gate_up_proj`` split over the intermediate dimension gate and up alike, ``down_proj`` over
its input), with clipping below every step's norm, under SGD and AdamW, against one process; and under FSDP 2 x
TP 2 (``Hybrid(dp_shard=2, tp=2)``) on 4 processes. Broken on purpose: the experts' outputs not
summed over the ranks (losses off by 7.9e-4), their inputs' gradients not summed (grads by 4.7e-5).
"""

from __future__ import annotations

import json

import pytest

from distributed import WORKERS, check, fork_run

pytest.importorskip("transformers")

TOL = 1e-9


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_experts")
    check(fork_run(WORKERS / "fused_experts_worker.py", str(out), "sgd", "adamw", nproc=2, timeout=300))
    return json.loads((out / "fused_experts.json").read_text())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_tensor_parallel_mixtral_is_one_process(results, optimizer):
    result = results[optimizer]
    assert len(result["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"])) < TOL, result
    assert result["grad_diff"] < TOL, result  # the first step's, every parameter: 8.3e-11 measured
    # Mixtral's router computes its softmax and routing weights in float32 (transformers'
    # `router_logits.float()`), so the router's gradients carry float32 rounding, which the ranks'
    # sums and one process's round differently: the norms of later steps differ by up to 6.7e-9
    # (1.3e-10 under SGD), and AdamW, which divides each gradient by its own scale, turns that into
    # 1.1e-7 in its weights after 3 steps (SGD: 4.3e-11). A rank that skipped the all-reduce of the
    # experts' outputs or of their inputs' gradients is off by 1e-2 and more.
    norm_tol, weight_tol = (TOL, TOL) if optimizer == "sgd" else (1e-8, 1e-6)
    assert max(abs(a - b) for a, b in zip(result["norms"], result["ref_norms"])) < norm_tol, result
    assert result["weight_diff"] < weight_tol, result
    assert result["losses"][-1] < result["losses"][0]


@pytest.fixture(scope="module")
def with_fsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_experts_fsdp")
    check(fork_run(WORKERS / "fused_experts_worker.py", str(out), "sgd", nproc=4, timeout=300))
    return json.loads((out / "fused_experts.json").read_text())["sgd"]


def test_fsdp_over_tensor_parallel_experts_is_one_process(with_fsdp):
    # Hybrid(dp_shard=2, tp=2): FSDP shards each expert's TP shard over the experts (dim 0)
    result = with_fsdp
    assert max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"])) < TOL, result
    assert max(abs(a - b) for a, b in zip(result["norms"], result["ref_norms"])) < TOL, result
    assert result["grad_diff"] < TOL and result["weight_diff"] < TOL, result
    assert result["placements"]["gate_up_proj"] == [["Shard", 0, 1], ["_StridedShard", 1, 2]]
    assert result["local_shapes"] == {"gate_up_proj": [2, 48, 32], "down_proj": [2, 32, 24]}


def test_each_rank_holds_its_half_of_every_experts_gate_and_up(results):
    result = results["sgd"]
    # strided over the intermediate dimension: [gate_r; up_r] on rank r, transformers' layout globally
    assert result["placements"] == {"gate_up_proj": [["_StridedShard", 1, 2]], "down_proj": [["Shard", 2, 1]]}
    assert result["local_shapes"] == {"gate_up_proj": [4, 48, 32], "down_proj": [4, 32, 24]}  # 2 x 48 / 2 rows


def test_a_plan_pointing_fused_experts_at_another_module_is_refused():
    from transformers import MixtralConfig, MixtralForCausalLM

    from kiln.models import HuggingFaceModel
    from kiln.parallel.transforms.tensor_parallel import resolve_tp_plan

    model = HuggingFaceModel(MixtralForCausalLM(MixtralConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                                              num_hidden_layers=1, num_attention_heads=2,
                                                              num_key_value_heads=1, num_local_experts=2)))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"fused_experts' selects 'model.model.layers.0.mlp.gate', a MixtralTopKRouter"
    ):
        resolve_tp_plan(model, {"model.model.layers.*.mlp.gate": "fused_experts"})
