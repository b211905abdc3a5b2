"""transformers' fused MoE experts under tensor parallelism (kiln.parallel.transforms.fused_experts),
with and without sequence parallelism.

workers/fused_experts_worker.py trains a tiny Mixtral (4 experts, top 2, intermediate 48) in float64
under ``TensorParallel(sequence_parallel=False)`` on 2 processes, the model's own plan (attention
column/row-wise, the experts' ``gate_up_proj`` split over the intermediate dimension gate and up
alike, ``down_proj`` over its input), with clipping below every step's norm, under SGD and AdamW,
against one process. Broken on purpose: the experts' outputs not summed over the ranks (losses off
by 7.9e-4), their inputs' gradients not summed (grads by 4.7e-5).

Sequence parallelism of the MoE decoders (kiln's default with tp > 1,
:func:`kiln.models.tp_plan.huggingface_sequence_parallel_plan`): a tiny Mixtral, a Qwen2-MoE (a
shared expert with its sigmoid gate) and a Qwen3-MoE (a MoE and a dense layer, per-head q/k norms),
hidden 32, 2 layers, 4 experts, top 2, 16 tokens, under SGD with accumulation over 2 micro-steps
and clipping, sequence and loss parallel, in the same 2-process launch; the Mixtral under FSDP 2 x
TP 2 on 4 processes (``Hybrid(dp_shard=2, tp=2)``). Each MoE block gathers the sequence, runs the
router whole and the experts split, and reduce-scatters its output (``Shard(1)``). Measured (torch
2.13, CPU, gloo): Qwen2-MoE and Qwen3-MoE within 8.9e-16 (losses) and 2e-18 (gradients, weights);
the Mixtral, whose router rounds its softmax to float32, within 1.4e-14 (losses), 4.5e-12 (norms),
1.4e-12 (gradients) and 8.2e-13 (weights). TOL = 1e-9.

Broken on purpose: the experts' partial sums claimed whole (``fused_experts_partial`` returning a
``Replicate()`` DTensor instead of ``Partial()``) fails every sequence-parallel parity case (Mixtral:
losses 1.7e-4, norms 1.0e-3, gradients 1.7e-4, weights 8.8e-5; Qwen2-MoE: losses 9.9e-5, gradients
3.2e-5, weights 1.7e-5); the block's output all-reduced (``desired_output_layouts=Replicate()``)
instead of reduce-scattered leaves the numbers equal (DTensor redistributes the sum to the
residual's layout) and fails test_a_sequence_parallel_moe_block_is_reduce_scattered (``['R']``).
"""

from __future__ import annotations

import json

import pytest

from distributed import WORKERS, check, fork_run

pytest.importorskip("transformers")

TOL = 1e-9
SP_CASES = ["sp_mixtral", "sp_qwen2_moe", "sp_qwen3_moe"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_experts")
    check(fork_run(WORKERS / "fused_experts_worker.py", str(out), "sgd", "adamw", *SP_CASES, nproc=2, timeout=300))
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
    check(fork_run(WORKERS / "fused_experts_worker.py", str(out), "sp_mixtral", nproc=4, timeout=300))
    return json.loads((out / "fused_experts.json").read_text())["sp_mixtral"]


@pytest.mark.parametrize("case", SP_CASES)
def test_a_sequence_parallel_moe_decoder_is_one_process(results, case):
    # accumulation over 2 micro-steps and clipping at once, SGD (see the AdamW remark below)
    result = results[case]
    assert max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"])) < TOL, result
    assert max(abs(a - b) for a, b in zip(result["norms"], result["ref_norms"])) < TOL, result
    assert result["grad_diff"] < TOL and result["weight_diff"] < TOL, result


@pytest.mark.parametrize("case", SP_CASES)
def test_a_sequence_parallel_moe_block_is_reduce_scattered(results, case):
    # the norms see half the sequence, each MoE block's output is reduce-scattered to the sequence
    # shards (Partial -> Shard(1), not all-reduced: ['R']), the logits are split over the vocabulary
    seen = results[case]["seen"]
    assert seen == {"norms": ["['S(1)']"], "norm_seq": [8], "moe": ["['S(1)']"], "logits": ["S(2)"]}, seen


def test_the_shared_expert_is_split_as_a_llama_mlp_and_its_gate_is_whole(results):
    shared = results["sp_qwen2_moe"]["shared"]
    assert shared == {"gate_proj": ["S(0)"], "up_proj": ["S(0)"], "down_proj": ["S(1)"], "shared_expert_gate": "plain"}


def test_fsdp_over_tensor_parallel_experts_is_one_process(with_fsdp):
    # Hybrid(dp_shard=2, tp=2) with sequence and loss parallelism: FSDP shards each expert's TP
    # shard over the experts (dim 0)
    result = with_fsdp
    assert result["seen"]["moe"] == ["['S(1)']"], result["seen"]
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


def _moe(model_type, **fields):
    from kiln.models import HuggingFaceModel

    config = dict(model_type=model_type, vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=8, num_experts=2,
                  num_local_experts=2, shared_expert_intermediate_size=8)  # fmt: skip
    return HuggingFaceModel.from_config({**config, **fields})


def test_the_moe_families_have_a_sequence_parallel_plan_and_others_are_refused():
    from kiln.models.tp_plan import huggingface_sequence_parallel_plan, huggingface_sequence_parallel_refusal
    from kiln.parallel.transforms.tensor_parallel import resolve_tp_plan

    for model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        model = _moe(model_type, mlp_only_layers=[1])  # Qwen-MoE: a dense second layer (Mixtral: ignored)
        assert huggingface_sequence_parallel_refusal(model) is None, model_type
        plan = resolve_tp_plan(model, huggingface_sequence_parallel_plan(model, loss_parallel=True))  # real modules
        # Mixtral's layers are all sparse: one pattern; Qwen-MoE's dense layer has its own entries
        experts = "model.model.layers.*.mlp.experts" if model_type == "mixtral" else "model.model.layers.0.mlp.experts"
        assert plan[experts].partial_output and "model.model.norm" in plan, model_type
        assert model_type == "mixtral" or "model.model.layers.1.mlp.down_proj" in plan
    why = huggingface_sequence_parallel_refusal(_moe("qwen3"))
    assert why is not None and "model_type 'qwen3' is not one of" in why and "\n" not in why


def test_under_a_pipeline_the_moe_families_keep_plain_tensor_parallelism():
    from kiln.parallel.transforms.sequence_parallel import sequence_parallel_plan

    model = _moe("mixtral")
    options = {"loss_parallel": None, "plan": None, "tp": 2, "pipeline": "pp=2"}
    assert sequence_parallel_plan(model, sequence_parallel=None, **options) is None
    with pytest.raises(ValueError, match="does not run in traced pipeline stages"):
        sequence_parallel_plan(model, sequence_parallel=True, **options)
