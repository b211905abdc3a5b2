"""Sequence parallelism and loss parallelism with tensor parallelism, against one process.

workers/sp_parity_worker.py trains a tiny Llama (transformers LlamaConfig, 2 layers, vocabulary 256,
grouped-query attention) and a tiny MoELlama (a dense and a MoE block with a shared expert,
vocabulary 96) in float64 under plain SGD (the Llama under AdamW too: ``llama_tp2_adamw``) with
kiln's Engine: tp=2 on 2 processes (TensorParallel()) and tp=2 x FSDP dp_shard=2 on 4
(Hybrid(dp_shard=2, tp=2)), with sequence and loss parallelism on by
default, each with gradient accumulation over 2 micro-steps and clipping below every step's norm at
once, against a plain torch loop on the global batch, two label positions of every sequence ignored
(-100). Compared: every step's loss, the first step's gradients, the weights after 2 steps and every
step's global norm. (Accumulation and clipping ran as two variants of every case, a launch's
work twice over; the one variant takes both paths. The plain step without either is the
Engine's default, which tests/test_hf_models.py's strategies take.) The one-process references are
computed once for the three launches (rank 0 of the first that needs one saves it in the shared
folder). And what runs where: the row-wise projections' outputs are
``Shard(1)`` (reduce-scattered to the sequence shards, not all-reduced), the norms see half the
sequence, the logits are ``Shard(2)`` with half the vocabulary on each rank, and no op of a
training micro-step (forward, loss, backward) leaves a tensor whose last dimension is the whole
vocabulary on any rank. ``llama_tp2_off`` (``sequence_parallel=False``) is the plain plan, the
"before": the whole logits on every rank.

Deep pipelines of a Hugging Face decoder (issue 32 item 6), in the same launches, each with
accumulation and clipping at once: a 4-layer Llama in 4 stages (1F1B) and an 8-layer one in 8
stages, 2 a rank (interleaved 1F1B), on 4 ranks; a 2-layer one in 2 stages x TP 2 x FSDP 2 on 8 ranks. Measured: the
largest difference 4.4e-15 (losses), 1.4e-17 (weights). A stage given the wrong rotary positions
(``position_ids + 1`` in kiln.models.hf_stages) fails tests/test_hf_stages.py at once.

Margin, measured (torch 2.13, CPU, gloo, 2 steps): the largest difference of any case is 5.3e-15
in losses and 4.4e-16 in gradients, weights and norms under SGD; under AdamW (``llama_tp2_adamw``,
which divides by the second moment) 1.8e-14 in weights and 1.8e-15 in norms; TOL = 1e-9.

Replicated parameters (sequence parallelism's norms, ``Replicate()`` weights applied to sequence
shards) get partial-sum gradients; test_replicated_gradients_are_summed_once_a_step counts where
they are summed. Before TensorParallel summed them (kiln.parallel.state.replicated_grads), the
numbers were right too (DTensor sums a ``Partial`` operand inside each op that meets it) but each
optimizer op summed them again: AdamW 15 all-reduces of the 5 norms a step, clipping 5 more.

Checked by breaking the code on purpose: the attention's row-wise output made ``Replicate`` (an
all-reduce where the reduce-scatter should be: ``o_proj``/``wo`` with ``output_layouts=Replicate()``)
leaves the numbers equal (DTensor redistributes the sum to the residual's layout) and fails
test_sequence_parallel_layout (row-wise outputs ``['R']`` beside ``['S(1)']``); a cross-entropy
normalised over each rank's vocabulary shard instead of the whole vocabulary fails every parity
case (llama_tp2: loss NaN, where a rank's shard holds none of a micro-batch's labels, gradients off
by 4.1e-2, weights by 6.5e-2; moe_tp2: loss by 0.72, gradients by 9.0e-2, weights by 8.5e-2).
"""

from __future__ import annotations

import json

import pytest

from distributed import WORKERS, check, fork_run

TOL = 1e-9
TWO = ["llama_tp2", "moe_tp2", "llama_tp2_off", "llama_tp2_adamw"]
FOUR = ["llama_fsdp2_tp2", "moe_fsdp2_tp2"]
# a Hugging Face Llama in 4 stages (1F1B) and in 8 stages, 2 a rank (interleaved 1F1B), on 4 ranks
PIPELINES = ["llama_pp4_1f1b", "llama_pp4_interleaved"]
EIGHT = ["llama_pp2_tp2_fsdp2"]  # 2 stages x tensor parallel 2 x FSDP 2, on 8 ranks
SP_CASES = [c for c in TWO + FOUR if not c.endswith("_off")]
SEQ = {"llama": 16, "moe": 8}
VOCAB = {"llama": 256, "moe": 96}


def _launch(tmp_path_factory, nproc, cases, refs):
    out = tmp_path_factory.mktemp(f"sp_parity{nproc}")
    env = {"SP_PARITY_REFS": str(refs)}  # the one-process references, shared by the launches
    check(fork_run(WORKERS / "sp_parity_worker.py", str(out), *cases, nproc=nproc, timeout=300, env=env))
    return json.loads((out / "sp_parity.json").read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    refs = tmp_path_factory.mktemp("sp_parity_refs")
    return {
        **_launch(tmp_path_factory, 2, TWO, refs),
        **_launch(tmp_path_factory, 4, FOUR + PIPELINES, refs),
        **_launch(tmp_path_factory, 8, EIGHT, refs),
    }


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", TWO + FOUR)
def test_sequence_parallel_parity(results, case):
    # accumulation over 2 micro-steps and clipping at once
    r = results[case]["accum2_clip"]
    assert not r["grad_missing"] and not r["weight_missing"], r
    for key in ("loss_abs", "grad_abs", "weight_abs", "norm_abs"):
        assert r[key] < TOL, f"{case}: {key} = {r[key]:.3g} (losses {r['losses']} vs {r['ref_losses']})"


@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", ["llama_tp2", "llama_tp2_adamw"])
def test_replicated_gradients_are_summed_once_a_step(results, case):
    # sequence parallelism's norms (5 Replicate weights of 64 float64) leave the backward as partial
    # sums; each step's last backward sums them in one all-reduce over tp (TensorParallel.backward),
    # the first backward of the accumulation none. The optimizer step then all-reduces no gradient:
    # only clipping's per-tensor norms of the sharded gradients (8 B each at most). Before, DTensor
    # summed them inside each optimizer op that read them: nothing in the backward, and in the step
    # SGD 5 and AdamW 15 all-reduces of 512 B (lerp_ once, addcmul_ twice a norm), clipping 5 more.
    r = results[case]["accum2_clip"]
    assert r["replicated_grad_bytes"] == 5 * 64 * 8
    # one a step, 2 steps (sp_parity_worker.STEPS)
    assert r["backward_all_reduce"] == [[1, r["replicated_grad_bytes"]]] * 2, r["backward_all_reduce"]
    assert all(moved <= 8 * r["sharded_grads"] for _, moved in r["step_all_reduce"]), r["step_all_reduce"]


@pytest.mark.world_size(8)
@pytest.mark.parametrize("case", PIPELINES + EIGHT)
def test_a_hugging_face_decoder_in_4_and_8_stages_is_one_process(results, case):
    # accumulation over 2 micro-steps and clipping at once, 4 pipeline microbatches each (2 with FSDP
    # and tensor parallelism inside each of 2 stages, on 8 ranks)
    r = results[case]["accum2_clip"]
    assert not r["grad_missing"] and not r["weight_missing"], r
    for key in ("loss_abs", "grad_abs", "weight_abs", "norm_abs"):
        assert r[key] < TOL, f"{case}: {key} = {r[key]:.3g} (losses {r['losses']} vs {r['ref_losses']})"


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", SP_CASES)
def test_sequence_parallel_layout(results, case):
    family = case.split("_")[0]
    seen = results[case]["accum2_clip"]["seen"]
    assert seen["rowwise"] == ["['S(1)']"], f"{case}: row-wise outputs {seen['rowwise']}, not reduce-scattered"
    assert seen["norms"] == ["['S(1)']"] and seen["norm_seq"] == [SEQ[family] // 2], seen
    assert seen["logits_placements"] == ["S(2)"] and seen["logits_local_shape"][-1] == VOCAB[family] // 2, seen
    assert seen["logits_local_bytes"] * 2 == seen["logits_full_bytes"], seen
    assert seen["largest_full_vocab_tensor"] == 0, f"{case}: a full-vocabulary tensor was made: {seen}"
    assert seen["loss_type"] == "Tensor"  # a plain tensor for the Engine, not a DTensor


@pytest.mark.world_size(2)
def test_sequence_parallel_false_is_the_plain_plan(results):
    seen = results["llama_tp2_off"]["accum2_clip"]["seen"]
    tokens = seen["logits_local_shape"][0] * seen["logits_local_shape"][1]
    assert seen["logits_placements"] == "plain" and seen["norm_seq"] == [SEQ["llama"]], seen
    assert seen["largest_full_vocab_tensor"] == tokens * VOCAB["llama"], seen  # the whole logits on the rank


# -- the switches, without processes --------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _tiny(model_type="llama", **fields):
    from kiln.models import HuggingFaceModel

    config = dict(
        model_type=model_type,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return HuggingFaceModel.from_config({**config, **fields})


def _plan(model, **kwargs):
    from kiln.parallel.transforms.sequence_parallel import sequence_parallel_plan

    options = {"sequence_parallel": None, "loss_parallel": None, "plan": None, "tp": 2, **kwargs}
    return sequence_parallel_plan(model, **options)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_llama_family_plans_name_real_modules(model_type):
    from torch.distributed.tensor.parallel import ColwiseParallel

    from kiln.parallel.transforms.tensor_parallel import resolve_tp_plan

    model = _tiny(model_type)
    plan = resolve_tp_plan(model, _plan(model))  # every pattern selects a module
    head = plan["model.lm_head"]
    assert isinstance(head, ColwiseParallel) and not head.use_local_output  # the logits stay sharded
    assert "model.model.layers.*.input_layernorm" in plan and "model.model.norm" in plan
    off = _plan(model, loss_parallel=False)["model.lm_head"]
    assert off.use_local_output  # gathered: loss_parallel=False


def test_the_default_is_off_where_kiln_has_no_plan():
    import torch

    from kiln.models import MoELlama

    assert _plan(torch.nn.Linear(2, 2)) is None
    assert _plan(_tiny(), tp=1) is None
    assert _plan(_tiny(), plan={"model.model.layers.*.mlp.up_proj": "colwise"}) is None
    assert _plan(_tiny(), blocker="pp=2") is None
    assert _plan(_tiny(), sequence_parallel=False) is None
    assert _plan(_tiny("qwen3")) is None
    assert "output" in _plan(MoELlama(vocab_size=32, dim=16, num_layers=1, num_heads=2, num_experts=2))


@pytest.mark.parametrize(
    "model, kwargs, words",
    [
        ("linear", {"sequence_parallel": True}, "kiln has no sequence-parallel plan for Linear"),
        ("qwen3", {"sequence_parallel": True}, "model_type 'qwen3' is not one of llama, mistral, qwen2, mixtral"),
        ("llama", {"sequence_parallel": True, "blocker": "pp=2"}, "does not run with pp=2"),
        ("llama", {"loss_parallel": True, "plan": {"x": "colwise"}}, "a tensor-parallel plan was given"),
        ("llama", {"loss_parallel": True, "sequence_parallel": False}, "loss_parallel=True with sequence_parallel"),
        ("tied", {"loss_parallel": True}, "ties it to the input embedding"),
        ("bare", {"loss_parallel": True}, "wrap it in kiln.models.HuggingFaceModel"),
        ("llama", {"sequence_parallel": "yes"}, "must be True, False or None"),
    ],
)
def test_asked_for_where_it_cannot_run_it_is_refused_in_one_line(model, kwargs, words):
    import torch

    built = {
        "linear": lambda: torch.nn.Linear(2, 2),
        "qwen3": lambda: _tiny("qwen3"),
        "llama": _tiny,
        "tied": lambda: _tiny(tie_word_embeddings=True),
        "bare": lambda: _tiny().model,
    }[model]()
    with pytest.raises(ValueError) as e:
        _plan(built, **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_tied_embeddings_keep_the_head_whole_by_default():
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

    plan = _plan(_tiny(tie_word_embeddings=True))
    assert isinstance(plan["model.lm_head"], PrepareModuleInput)
    assert isinstance(plan["model.model.embed_tokens"], PrepareModuleOutput)


def test_the_strategies_and_the_run_file_carry_the_switches():
    from kiln.config.compute import ComputeConfig
    from kiln.parallel import Hybrid, TensorParallel

    assert TensorParallel(sequence_parallel=False).describe()["sequence_parallel"] is False
    assert repr(TensorParallel(loss_parallel=False)) == "TensorParallel(plan=None, loss_parallel=False)"
    assert Hybrid(tp=2, sequence_parallel=False).describe()["sequence_parallel"] is False
    cc = ComputeConfig(tp=2, sequence_parallel=False, loss_parallel=False)
    assert cc.strategy_options == {"sequence_parallel": False, "loss_parallel": False}
    assert ComputeConfig(tp=2).strategy_options == {}


def test_token_mean_cross_entropy_of_plain_logits_is_torchs():
    import torch
    import torch.nn.functional as F

    from kiln.models.tp_plan import token_mean_cross_entropy

    logits, target = torch.randn(2, 5, 7, dtype=torch.float64), torch.randint(0, 7, (2, 5))
    target[0, :2] = -100
    want = F.cross_entropy(logits.reshape(-1, 7), target.reshape(-1), ignore_index=-100)
    assert torch.equal(token_mean_cross_entropy(logits, target), want)
