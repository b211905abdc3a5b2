"""kiln plan --search (kiln.planning.search): the plans of a transformer on a world of devices, priced
by the documented cost model; strategy="auto" ranking its candidates with the same model; and the dry
run of Llama's grouped-query attention under pipeline x tensor parallelism (kiln.parallel.pipelining.tp_trace).

Published configurations the docs compare with (docs/planning.md): torchtitan's Llama 3.1 8B on 8
H100 (FSDP 8, local batch 2, global 16, seq 8192) and 70B on 256 H100 (FSDP 32 x TP 8, global 512);
nnScaler's Llama 3 70B on 16 MI300X (2 pipeline stages of 4 devices, 2 replicas; 153 GB constraint).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from kiln.cost.devices import COMPUTE_EFFICIENCY, DEVICES, device_class
from kiln.cost.step_time import data_parallel_seconds
from kiln.planning.search import ModelShape, parse_bytes, search

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "workers"))  # search_models
sys.path.insert(0, str(ROOT / "examples"))  # lm_data

transformers = pytest.importorskip("transformers")

GiB = 1024**3
N_8B = 8_030_261_248  # Llama-3-8B's parameters (the dry run's count, docs/planning.md)


def _shape(factory: str) -> ModelShape:
    import search_models

    with torch.device("meta"):
        return ModelShape.from_model(getattr(search_models, factory)())


@pytest.fixture(scope="module")
def llama8b() -> ModelShape:
    return _shape("llama3_8b")


@pytest.fixture(scope="module")
def llama70b() -> ModelShape:
    return _shape("llama3_70b")


def _shape_of(plan) -> tuple:
    return (plan.dp_shard, plan.tp, plan.pp, plan.activation_checkpointing, plan.micro_batch_size, plan.microbatches)


def test_llama3_8b_on_8_h100_next_to_torchtitans_fsdp_8(llama8b):
    assert llama8b.num_parameters == N_8B and llama8b.num_layers == 32 and len(llama8b.blocks) == 32
    result = search(llama8b, 8, device_class("h100"), budget=None, global_batch=16, seq_len=8192)
    shapes = [_shape_of(p) for p in result.plans]
    # FSDP 4 x TP 2 without checkpointing, 4 accumulated microbatches of 1 sequence, just inside 80 GiB
    assert shapes[0] == (4, 2, 1, None, 1, 4) and result.plans[0].memory["total"] <= 80 * GiB
    # torchtitan's FSDP 8 (local batch 2) does not fit without checkpointing by the estimate (153 GiB;
    # the dry run measures 138.4 GiB of activations, as estimated, and a 149.6 GiB peak); every block
    # checkpointed, one microbatch of 2 is 12th and two accumulated of 1 15th (accumulation under
    # FSDP keeps the unsharded fp32 gradients): the plans with tensor parallelism run sequence
    # parallelism (issue 32), inside pipeline stages too, which hold and compute less, and
    # pipelines without recomputation rank before it, interleaved (2 stages a rank) among them
    assert not any(s[:4] == (8, 1, 1, None) for s in shapes)
    fsdp8 = result.plans[shapes.index((8, 1, 1, "full", 1, 2))]
    assert shapes.index((8, 1, 1, "full", 2, 1)) == 11 and shapes.index((8, 1, 1, "full", 1, 2)) == 14
    assert [p.schedule for p in result.plans[3:5]] == ["interleaved1f1b", "1f1b"]  # both (2, 2, 2, None, 1, 8)
    assert shapes[3] == shapes[4] == (2, 2, 2, None, 1, 8)
    # memory that does not depend on the batch: the closed form the dry run measures (docs/planning.md)
    assert fsdp8.memory["params"] == fsdp8.memory["grads"] == N_8B * 4 // 8 == 4_015_130_624
    assert fsdp8.memory["optimizer"] == N_8B * 8 // 8
    # the parameters gathered in bf16 twice per microbatch, the fp32 gradients reduce-scattered once:
    # the dry run of this plan (kiln plan --search --confirm) counts the same bytes
    assert fsdp8.collectives == {"all_gather": {"dp_shard": 2 * 2 * N_8B * 2}, "reduce_scatter": {"dp_shard": N_8B * 4}}
    # compute: 4 (checkpointed) x (2 x non-embedding parameters + the attention's 4 x layers x seq x
    # heads x head_dim) FLOPs per token, 16 x 8192 / 8 tokens, at COMPUTE_EFFICIENCY of 989.4 TFLOP/s;
    # communication: 7/8 of (gathered + reduce-scattered) bytes over NVLink at 450 GB/s
    per_token = 2 * (N_8B - 128256 * 4096 - 4096) + 4 * 32 * 8192 * 4096
    assert fsdp8.seconds["compute"] == pytest.approx(4 * per_token * 16 * 8192 / 8 / (989.4e12 * COMPUTE_EFFICIENCY))
    assert fsdp8.seconds["communication"] == pytest.approx(7 / 8 * (4 * N_8B * 2 + 4 * N_8B) / 450e9)
    assert fsdp8.seconds["bubble"] == 0
    # every candidate is accounted for: feasible, or dropped for a named reason
    assert len(result.plans) + sum(result.infeasible.values()) == result.searched
    assert result.plans == sorted(result.plans, key=lambda p: p.seconds["total"])


def test_llama3_70b_on_256_h100_ranks_torchtitans_fsdp32_tp8(llama70b):
    result = search(llama70b, 256, device_class("h100"), budget=None, global_batch=512, seq_len=8192)
    shapes = [_shape_of(p) for p in result.plans]
    # first: 4 pipeline stages of TP 8 x FSDP 8, no recomputation, 64 microbatches of 1 (79.8 GiB of
    # 80), then 8 stages of TP 8 x FSDP 4: since a stage under FSDP computes, sends and keeps its
    # residual stream in bf16 (it was traced in fp32: twice the bytes), and a pipeline's activations
    # peak before its gradients exist, a pipeline without recomputation fits, and saves the
    # recomputed forward (a third of the compute) for a 3/64 bubble
    assert shapes[:2] == [(8, 8, 4, None, 1, 64), (4, 8, 8, None, 1, 128)]
    assert result.plans[0].memory["total"] <= 80 * GiB
    best_flat = result.plans[3]  # the best plan without a pipeline, 21% slower than the first
    assert _shape_of(best_flat) == (64, 4, 1, "full", 8, 1)
    assert 1.20 < best_flat.seconds["total"] / result.plans[0].seconds["total"] < 1.21
    # torchtitan's FSDP 32 x TP 8 with full checkpointing (local batch 16) is 2.3% slower than the
    # best plan without a pipeline: with sequence and loss parallelism (issue 32) TP 8 no longer
    # holds the whole vocabulary's logits and all-reduces every block's activations (it was tenth,
    # 15% slower)
    theirs = result.plans[5]
    assert _shape_of(theirs) == (32, 8, 1, "full", 16, 1)
    assert 1.02 < theirs.seconds["total"] / best_flat.seconds["total"] < 1.03
    # TP 8 stays inside a node (NVLink); FSDP 32 crosses nodes (the network). Each block gathers and
    # reduce-scatters one microbatch of 16 x 8192 tokens in bf16 (6 gathers and 5 reduce-scatters a
    # checkpointed block, 2 more for the embedding and the head); the norms' weight gradients, partial
    # over tp, are all-reduced once a step (2 norms a block and the last one, bf16)
    per_call = 16 * 8192 * 8192 * 2
    assert theirs.collectives["all_gather"]["tp"] == (6 * 80 + 2) * per_call
    assert theirs.collectives["reduce_scatter"]["tp"] == (5 * 80 + 2) * per_call
    assert theirs.collectives["all_reduce"]["tp"] == (2 * 80 + 1) * 8192 * 2
    tp_bytes = sum(theirs.collectives[k]["tp"] for k in ("all_gather", "reduce_scatter"))
    tp_time = 7 / 8 * (tp_bytes + 2 * theirs.collectives["all_reduce"]["tp"]) / 450e9
    ag, rs = theirs.collectives["all_gather"]["dp_shard"], theirs.collectives["reduce_scatter"]["dp_shard"]
    assert theirs.seconds["communication"] == pytest.approx(tp_time + 31 / 32 * (ag + rs) / 50e9)
    assert result.infeasible["tp does not divide the attention heads or key/value heads"] > 0  # tp 16, 32, ...


def test_nnscaler_llama3_70b_on_16_mi300x(llama70b):
    # nnScaler's example: 2 pipeline stages of 4 devices, 2 replicas, 64 accumulated microbatches of 1
    # sequence (global batch 128), no recomputation, within --gpu_mem_constraint 153
    # with sequence parallelism inside the stages (issue 32), a pipeline's activations are split over
    # tp too: 2 stages of TP 8 without recomputation fit 192 GB; under 153 GiB, 4 checkpointed stages
    # of FSDP 2 x TP 2 (a stage keeps its blocks gathered and its fp32 gradients unsharded across
    # the microbatches, Hybrid's default under pp: the fewer parameters a stage has, the less it pays)
    # came first; since the stages under FSDP send and keep bf16 (traced in FSDP's dtype) and a
    # pipeline's activations peak before its gradients exist, pipelines without recomputation fit:
    # 4 stages of TP 4 within 192 GB, 2 of TP 8 within 153 GiB; nnScaler's own shape, checkpointed,
    # is third under the constraint (after 4 interleaved stages of FSDP 2 x TP 2)
    first = {None: (1, 4, 4, None, 1, 128), 153 * GiB: (1, 8, 2, None, 1, 128)}
    for budget in (None, 153 * GiB):  # the data sheet's 192 GB, and nnScaler's constraint
        result = search(llama70b, 16, device_class("mi300x"), budget=budget, global_batch=128, seq_len=8192)
        shapes = [_shape_of(p) for p in result.plans]
        assert shapes[0] == first[budget]
        assert (2, 4, 2, None, 1, 64) not in shapes  # theirs does not fit without recomputation by our estimate
        theirs = result.plans[shapes.index((2, 4, 2, "full", 1, 64))]
        assert theirs.seconds["total"] == pytest.approx(89.77, abs=0.01)  # they measured 100.3 s


def test_a_pipelines_first_and_last_stage_are_the_dry_runs_at_scale(llama8b, llama70b):
    # What the dry run measures (docs/planning.md), against the closed form's moments:
    # * Llama-3-8B at FSDP 32 x TP 8 x PP 2 (1F1B), full checkpointing, 2 microbatches of one
    #   8192-token sequence: 16.78 GiB of activations on the last stage, 5.75 on the first. The
    #   vocabulary-split embedding's whole-vocabulary gradient is on the first stage only (the last
    #   estimated 18.49 while it was counted on every stage); the first stage peaks at the
    #   embedding's backward (its bf16 gradient over the whole vocabulary, the fp32 one FSDP keeps).
    # * Llama-3-70B at PP 8 interleaved (2 stages of 5 blocks a rank) x TP 8 x FSDP 8, 8 microbatches
    #   of one sequence: 20.29 GiB on the last rank, 10.65 on the first. Every forward runs in the
    #   warm-up, so each rank's two stages run their backwards one after the other: at the last
    #   rank's loss only its last stage's gradients exist (both stages' counted: 21.35), and the
    #   first rank peaks at its embedding's backward with its other stage done (the warm-up's end
    #   with both stages' gradients counted: 12.20).
    from kiln.planning.search_memory import plan_memory

    def moments(shape, **plan):
        memory = plan_memory(
            shape, checkpointing=True, micro_batch_size=1, seq_len=8192, precision="amp_bf16", optimizer_factor=2,
            **plan,
        )  # fmt: skip
        first = max(memory.moments["first_stage"], memory.moments["embedding_backward"])
        assert memory.activations == max(first, memory.moments["loss"])
        return first / GiB, memory.moments["loss"] / GiB

    first, last = moments(llama8b, dp=32, tp=8, pp=2, microbatches=2)
    assert last == pytest.approx(16.78, rel=0.002) and first == pytest.approx(5.75, rel=0.02)
    first, last = moments(llama70b, dp=8, tp=8, pp=8, microbatches=8, stages_per_rank=2)
    assert last == pytest.approx(20.29, rel=0.01) and first == pytest.approx(10.65, rel=0.01)


def test_infeasible_plans_are_dropped_for_their_reason(llama8b):
    result = search(llama8b, 64, device_class("a100"), budget=8 * GiB, global_batch=6, seq_len=4096)
    reasons = result.infeasible
    # tp 16 (pp 1, 2, 4), 32 (pp 1, 2), 64 (pp 1) over 8 key/value heads, with and without checkpointing
    assert reasons["tp does not divide the attention heads or key/value heads"] == 2 * 6
    assert reasons["the global batch does not split over the data-parallel ranks"] > 0  # 6 over 64, 32, 16, ...
    assert reasons["pp above the number of layers (a stage without layers)"] == 2  # pp 64, tp 1
    # kiln cuts a Hugging Face Llama into any number of stages (kiln.models.hf_stages)
    assert llama8b.deep_pipeline and not any(r.startswith("pp above 2") for r in reasons)
    assert all(p.memory["total"] <= 8 * GiB for p in result.plans)
    nothing = search(llama8b, 8, device_class("h100"), budget=1 * GiB, global_batch=8, seq_len=8192)
    assert nothing.plans == [] and nothing.infeasible["memory over the budget"] > 0


def test_the_device_table_agrees_with_the_mfu_peaks():
    from kiln.callbacks.device_flops import _PEAK

    for name, key in (("a100", "a100"), ("h100", "h100-sxm"), ("h200", "h200"), ("b200", "b200")):
        assert DEVICES[name].bf16_flops == _PEAK[key]["bf16"], name
    assert device_class("H100").name == "h100"
    with pytest.raises(ValueError, match=r"--device 'tpu' is not a device class kiln knows; expected one of a100"):
        device_class("tpu")
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("141GB") == 141 * 10**9 and parse_bytes(5) == 5
    with pytest.raises(ValueError, match=r"--memory 'lots' is not a size above 0"):
        parse_bytes("lots")


def test_auto_ranks_its_candidates_with_the_same_cost_model():
    from torch import nn

    from kiln.cost.memory import plan_table

    cpu = DEVICES["cpu"]
    # ddp all-reduces the gradients (2 x 7/8 of their bytes); zero3 reduce-scatters them and gathers
    # the parameters twice; all inside one node
    assert data_parallel_seconds("ddp", 100, 100, 8, cpu, devices_per_node=8) == pytest.approx(2 * 7 / 8 * 100 / 20e9)
    assert data_parallel_seconds("zero3", 100, 100, 8, cpu, devices_per_node=8) == pytest.approx(7 / 8 * 300 / 20e9)
    assert data_parallel_seconds("zero3", 100, 100, 16, cpu, devices_per_node=8) == pytest.approx(
        15 / 16 * 300 / 1.25e9
    )
    assert data_parallel_seconds("tp", 100, 100, 8, cpu) is None

    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    rows = {r.strategy: r for r in plan_table(model, torch.optim.AdamW, world_size=4, budget=1e12)}
    assert rows["ddp"].chosen and rows["ddp"].seconds == rows["zero2"].seconds  # a tie: the earlier row
    assert "least communication" in rows["ddp"].note
    # zero1 and zero2 fit, ddp does not: zero2 moves fewer bytes than zero1 (the old rule took zero1)
    rows = {r.strategy: r for r in plan_table(model, torch.optim.AdamW, world_size=4, budget=rows["zero1"].total)}
    assert not rows["ddp"].fits and rows["zero1"].fits and rows["zero2"].chosen
    assert rows["zero2"].seconds < rows["zero1"].seconds == rows["zero3"].seconds  # 2G + P, G + 2P


def test_kiln_plan_search_prints_json_and_refuses_bad_input(capsys):
    from kiln.cli.main import main

    args = ["plan", "--search", "--model", "search_models:llama3_8b", "--world-size", "8", "--seq-len", "8192"]
    assert main([*args, "--global-batch", "16", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "h100" and out["budget"] == 80 * GiB and out["global_batch"] == 16
    assert out["model"]["num_parameters"] == N_8B and len(out["plans"]) == 3
    first = out["plans"][0]
    assert (first["dp_shard"], first["tp"], first["pp"]) == (4, 2, 1)
    assert set(first) >= {"memory", "collectives", "seconds", "tokens_per_second_per_device", "overrides"}
    assert first["schedule"] == "1f1b"
    assert first["overrides"][:6] == ["--compute_config.dp_shard", "4", "--compute_config.tp", "2"] + [
        "--compute_config.pp",
        "1",
    ]
    assert out["feasible"] + sum(out["infeasible"].values()) == out["searched"]
    assert main([*args, "--global-batch", "16"]) == 0
    text = capsys.readouterr().out
    # without a run file, the follow-up says one is needed (with -f it names it: test_confirm_...)
    assert "* 4 x 2 x 1" in text
    # the 4th plan: 2 x 2 x 2 interleaved (2 stages a rank), the 5th the same shape under 1F1B
    rows = [line for line in text.splitlines() if line.startswith("  2 x 2 x 2")]
    assert [r.split()[5] for r in rows[:2]] == ["i", "-"], rows
    assert "dry-run it with a run file of this model: kiln plan -f RUN.yaml --dry-run --world-size 8" in text
    for bad, message in (
        (["--memory", "lots"], "--memory 'lots' is not a size above 0"),
        (["--device", "tpu"], "--device 'tpu' is not a device class kiln knows"),
        (["--top", "0"], "--top=0 must be >= 1"),
    ):
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    assert main(["plan", "--search", "--model", "search_models:llama3_8b", "--world-size", "8"]) == 2
    assert "pass --seq-len" in capsys.readouterr().err


def test_dry_run_of_grouped_query_attention_under_pp_x_tp():
    """Llama with 8 query / 2 key-value heads at pp 2 x dp_shard 2 x tp 2 (world 8) on the fake world,
    under amp_bf16: kiln refused this before (the trace kept the whole model's key/value heads), and
    FSDP's bf16 parameters stopped the stage at the trace's dtype assertions; each stage's rank holds
    its stage's parameters split by tensor parallelism, then FSDP's shard of them. Plain tensor
    parallelism (sequence_parallel=False: the default runs it inside the stages, which
    tests/test_search_vs_dry_run.py's pp x tp plan measures), whose all-reduces this counts."""
    from kiln.config.args import load_trainer_args
    from kiln.planning.dry_run import dry_run

    hidden, inter, vocab, seq = 64, 128, 256, 32
    model = dict(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
    run = {
        "compute_config": {
            "pp": 2,
            "tp": 2,
            "dp_shard": -1,
            "strategy_options": {"split_points": ["model.model.layers.1"]},
            "sequence_parallel": False,
        },
        "micro_batch_size": 2,
        "max_train_steps": 1,
        "precision": "amp_bf16",
        "model": {"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": model}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 1e-3}},
        "dataset": {"type": "lm_data.StdlibText.from_stdlib", "train_args": {"seq_len": seq, "max_bytes": 5000}},
    }
    report = dry_run(load_trainer_args(run, world_size=8), 8)
    first, last = report.ranks
    assert (first.coordinates, last.coordinates) == (
        {"pp": 0, "dp_shard": 0, "tp": 0},
        {"pp": 1, "dp_shard": 0, "tp": 0},
    )
    kv = 2 * 8  # key/value heads x head_dim
    # one block: q, o (hidden x hidden), k, v (kv x hidden), gate, up, down (inter x hidden) split over
    # tp 2, then dim 0 over dp_shard 2; its two norms only over dp_shard; fp32
    block = 2 * hidden * hidden // 2 // 2 + 2 * kv * hidden // 2 // 2 + 3 * inter * hidden // 2 // 2 + 2 * hidden // 2
    assert first.params == 4 * (block + vocab * hidden // 2)  # + the embedding (whole under tp), sharded
    assert last.params == 4 * (block + hidden // 2 + vocab * hidden // 2)  # + the final norm and LM head
    # 2 pipeline microbatches of 1 sequence through 1 block per stage: 7 all-reduces each, the
    # outputs of o_proj and down_proj forward, the input gradients of q, k, v, gate and up, all bf16
    # as FSDP's stage computes them (the stages are traced in it; a float32 trace made the 5
    # gradients float32: 98,304 B)
    for rank in (first, last):
        assert rank.calls["all_reduce"] == {"tp": 7 * 2}
        assert rank.collectives["all_reduce"] == {"tp": 7 * 2 * 2 * seq * hidden}
        assert rank.grads == rank.params


def test_a_traced_stage_runs_the_models_casts_on_bf16():
    from torch import nn

    from kiln.parallel.pipelining.traced_casts import drop_cast_assertions

    class Norm(nn.Module):
        def forward(self, x):
            return (x.to(torch.float32) * 3).sum(-1)

    traced = torch.export.export(Norm(), (torch.randn(2, 3),), strict=False).module()
    x = torch.randn(2, 3).to(torch.bfloat16)  # what FSDP's bf16 policy hands a stage traced in fp32
    with pytest.raises(RuntimeError, match="Tensor dtype mismatch"):
        traced(x)
    assert drop_cast_assertions(traced) == 1
    out = traced(x)
    assert out.dtype == torch.float32 and torch.equal(out, Norm()(x))


def test_confirm_dry_runs_the_first_plans(tmp_path, monkeypatch, capsys):
    import yaml

    from kiln.cli.main import main

    model = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    run = {
        "micro_batch_size": 2,
        "max_train_steps": 1,
        "precision": "fp32",
        "model": {"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": model}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 1e-3}},
        "dataset": {"type": "lm_data.StdlibText.from_stdlib", "train_args": {"seq_len": 32, "max_bytes": 5000}},
    }
    (tmp_path / "my run.yaml").write_text(yaml.safe_dump(run))
    monkeypatch.chdir(tmp_path)
    args = ["plan", "-f", "my run.yaml", "--world-size", "2", "--search", "--device", "cpu", "--memory", "1GiB"]
    assert main([*args, "--json", "--confirm", "1"]) == 0
    searched = json.loads(capsys.readouterr().out)
    assert searched["seq_len"] == 32 and searched["global_batch"] == 4  # the first microbatch; 2 x 2 ranks
    first, second = searched["plans"][:2]
    # the first plan was dry-run (the run file with its overrides) and is ranked by what it measured
    assert first["confirmed"] and not second["confirmed"]
    assert set(first["estimated_memory"]) == set(first["memory"]) and first["memory"]["total"] <= 1024**3
    # the follow-up command names the run file given, quoted for the shell
    assert main(args) == 0
    assert 'dry-run it: kiln plan -f "my run.yaml" --dry-run --world-size 2 --compute_config.dp_shard' in (
        capsys.readouterr().out
    )
    assert main([*args, "--confirm", "0"]) == 2
    assert "--confirm=0 must be >= 1" in capsys.readouterr().err


def test_the_search_runs_a_moe_familys_sequence_parallelism_outside_pipeline_stages_only():
    # Mixtral's sequence-parallel plan (kiln.models.tp_plan) runs with tp > 1, but its MoE blocks keep
    # plain tensor parallelism inside traced pipeline stages: the search prices what Hybrid runs
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    with torch.device("meta"):
        shape = ModelShape.from_model(MixtralForCausalLM(config))
    assert shape.sequence_parallel and not shape.sequence_parallel_stages
    assert shape.sequence_parallel_at(2, 1) and not shape.sequence_parallel_at(2, 2)
    assert not shape.vocab_split_at(2, 2) and shape.vocab_split_at(2, 1)
