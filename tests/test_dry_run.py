"""kiln.planning.dry_run: a run's setup and first step as one rank of a world of 8 to 512, on torch's
fake process group and fake tensors, in this process.

What each rank holds is checked against the closed form of FSDP2 over tensor parallelism (each
parameter split by the tensor-parallel plan, then its dim 0 cut into ``dp_shard`` chunks, each
padded to the largest: ``ceil(rows / dp_shard)`` rows), and what it moves against the collectives
that layout needs. The same numbers against real gloo runs: tests/test_plan_vs_real.py. Every
configuration error is the message of the check the real run calls.
"""

from __future__ import annotations

import functools
import gc
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from kiln.config.args import load_trainer_args
from kiln.config.overrides import ConfigError
from kiln.planning.comm_count import mesh_dimension
from kiln.planning.dry_run import dry_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # lm_data

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def _stdlib_read_once():
    """Every dry run here takes its first microbatch from lm_data's text of the standard library,
    which walks and reads the whole stdlib tree each time: read once per size in this module."""
    import lm_data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_data, "stdlib_bytes", functools.cache(lm_data.stdlib_bytes))
        yield


@pytest.fixture(scope="module", autouse=True)
def _imports_frozen():
    """What is alive before this module's dry runs (torch's, transformers' and kiln's modules: over a
    million objects) is never their garbage: frozen, the collection each rank's step makes first
    (kiln.planning.dry_run.measure_step) scans only what the dry runs made (0.2-0.4 CPU-s less a rank)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


LAYERS, HIDDEN, INTER, VOCAB, SEQ, MICRO = 2, 128, 256, 512, 64, 2
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # transformers' Llama plan: dim 0 split
ROWWISE = ("o_proj", "down_proj")  # dim 1 split


def config(compute: dict, *, heads: int = 8, kv_heads: int = 8, layers: int = LAYERS, **extra) -> dict:
    """A small Llama run (bf16 autocast over fp32 parameters, every block checkpointed, AdamW)."""
    model = dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    return {
        "compute_config": compute,
        "micro_batch_size": MICRO,
        "max_train_steps": 1,
        "precision": "amp_bf16",
        "activation_checkpointing": "full",
        "model": {"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": model}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 1e-3}},
        "dataset": {"type": "lm_data.StdlibText.from_stdlib", "train_args": {"seq_len": SEQ, "max_bytes": 20000}},
        **extra,
    }


def closed_form(tp: int, dp: int, split_vocab: bool = False) -> tuple[int, int]:
    """(parameter bytes of rank 0, parameter tensors): fp32, split by the plan, then FSDP's padded chunk.
    ``split_vocab``: the embedding and the LM head split over the vocabulary too (loss parallelism)."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    total, count = 0, 0
    for name, p in model.named_parameters():
        shape = list(p.shape)
        if name.split(".")[-2] in COLWISE:
            shape[0] //= tp
        elif name.split(".")[-2] in ROWWISE:
            shape[1] //= tp
        elif split_vocab and name.split(".")[-2] in ("embed_tokens", "lm_head"):
            shape[0] //= tp  # the vocabulary rows
        total += math.ceil(shape[0] / dp) * math.prod(shape[1:]) * 4
        count += 1
    return total, count


@functools.cache
def fsdp8(tied: bool = False):
    """The dry run of FSDP alone on 8 ranks, the embedding and the LM head two weights or one
    (``tie_word_embeddings``): the closed form and the tied-embeddings tests read the untied one."""
    run = config({"strategy": "fsdp"})
    run["model"]["args"]["config"]["tie_word_embeddings"] = tied
    return dry_run(load_trainer_args(run, world_size=8), 8)


# FSDP alone and FSDP over tensor parallelism at the largest world; the world of 64 between them
# (fsdp8xtp8) ran the same code with another dp_shard: the closed form's dp_shard is also checked
# at 8 (fsdp8), and the tp 8 layout at 64 and 128 ranks by the kiln train and kiln plan tests below.
@pytest.mark.parametrize(
    "world, compute, tp",
    [
        (8, {"strategy": "fsdp"}, 1),
        (512, {"tp": 8, "dp_shard": -1, "sequence_parallel": False}, 8),
    ],
    ids=["fsdp8", "fsdp64xtp8"],
)
def test_what_a_rank_holds_and_moves_is_the_closed_form(world, compute, tp):
    report = fsdp8() if tp == 1 else dry_run(load_trainer_args(config(compute), world_size=world), world)
    dp = world // tp
    params, tensors = closed_form(tp, dp)
    (rank,) = report.ranks
    assert (rank.rank, report.mesh) == (
        0,
        {"dp_shard": dp} if tp == 1 else {"pp": 1, "dp_replicate": 1, "dp_shard": dp, "tp": tp},
    )
    assert rank.params == params
    assert rank.grads == params  # one fp32 reduce-scatter output per block, of the padded shards
    assert rank.optimizer == 2 * params + 4 * tensors  # AdamW's two moments, and a float32 step count each
    # every block gathered in bf16 twice (forward, and again for the backward: reshard_after_forward),
    # its fp32 gradients reduce-scattered once: both n chunks of the padded shards
    assert rank.collectives["all_gather"] == {"dp_shard": params // 2 * dp * 2}
    assert rank.collectives["reduce_scatter"] == {"dp_shard": params * dp}
    if tp > 1:
        # a row-wise layer's output summed over the tensor-parallel ranks: bf16 activations of the microbatch
        assert rank.collectives["all_reduce"] == {"tp": rank.calls["all_reduce"]["tp"] * MICRO * SEQ * HIDDEN * 2}
        assert rank.calls["all_reduce"]["tp"] == 8 * LAYERS
    assert set(rank.collectives) == {"all_gather", "reduce_scatter"} | ({"all_reduce"} if tp > 1 else set())
    assert 0 < rank.activations < rank.peak and rank.peak >= rank.params + rank.optimizer + rank.activations
    # the sharded checkpoint's tensors: the parameters' shards, AdamW's moments and step counts
    assert rank.checkpoint_bytes == 3 * params + 4 * tensors


@pytest.fixture(scope="module")
def plan_json(tmp_path_factory) -> dict:
    """``kiln plan -f run.yaml --world-size 128 --dry-run --json`` of tensor parallelism 8 (sequence and
    loss parallel: a Llama's default), parsed, and what the run's folder held after it: the closed
    form of that layout and the command line's report are read from one dry run."""
    import contextlib
    import io

    from kiln.cli.main import main

    folder = tmp_path_factory.mktemp("plan")
    path = _write(folder, config({"tp": 8, "dp_shard": -1}))
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.chdir(folder)
        code = main(["plan", "-f", str(path), "--world-size", "128", "--dry-run", "--json"])
    return {"code": code, "report": json.loads(out.getvalue()), "files": sorted(p.name for p in folder.iterdir())}


class _Rank:
    """A rank of the JSON report, read as a RankReport is."""

    def __init__(self, fields: dict) -> None:
        self.__dict__.update(fields)


def test_sequence_and_loss_parallel_hold_and_move_the_closed_form(plan_json):
    # the default with tp > 1 for a Llama: the residual stream sharded on the sequence, the embedding
    # and the LM head on the vocabulary (issue 32); dp_shard 16 of 128 ranks (64: test_kiln_train_dry_run_...)
    report = plan_json["report"]
    dp = report["world_size"] // 8
    params, tensors = closed_form(8, dp, split_vocab=True)
    (rank,) = [_Rank(r) for r in report["ranks"]]
    assert rank.params == rank.grads == params and rank.optimizer == 2 * params + 4 * tensors
    assert params < closed_form(8, dp)[0]  # the embedding and the head no longer whole on each rank
    # each tensor-parallel collective moves one bf16 microbatch of the whole sequence: gathered before
    # the attention and the MLP (twice with checkpointing), before the head, and in the backward of
    # each reduce-scatter; reduce-scattered after o_proj and down_proj (twice), after the embedding,
    # and in the backward of each gather. The loss's all-reduces over the vocabulary shards are per
    # token (max, sum of exponentials, the target's logit, ...), never tokens x vocab.
    whole = MICRO * SEQ * HIDDEN * 2
    assert rank.calls["all_gather"]["tp"] == 14 and rank.calls["reduce_scatter"]["tp"] == 12
    assert rank.collectives["all_gather"]["tp"] == 14 * whole
    assert rank.collectives["reduce_scatter"]["tp"] == 12 * whole
    assert rank.collectives["all_reduce"]["tp"] == rank.calls["all_reduce"]["tp"] * MICRO * SEQ * 2
    # no more bytes on the wire than the all-reduces of tensor parallelism without it (a ring
    # all-reduce moves its bytes twice, a gather or a reduce-scatter once): 8 per layer of `whole`
    moved = rank.collectives["all_gather"]["tp"] + rank.collectives["reduce_scatter"]["tp"]
    moved += 2 * rank.collectives["all_reduce"]["tp"]
    assert moved <= 2 * 8 * LAYERS * whole


PIPELINE = {"pp": 2, "dp_shard": -1, "strategy_options": {"split_points": ["model.model.layers.1"]}}


@functools.cache
def pipeline_report() -> tuple[object, int]:
    """The dry run of a 2-stage pipeline at 16 ranks (fp32) and the number of torch.export traces
    it made (two tests read it: one run)."""
    import torch.export

    traced = []
    export = torch.export.export

    def counting(*args, **kwargs):
        traced.append(1)
        return export(*args, **kwargs)

    torch.export.export = counting
    try:
        report = dry_run(load_trainer_args(config(PIPELINE, precision="fp32"), world_size=16), 16)
    finally:
        torch.export.export = export
    return report, len(traced)


def test_a_pipeline_reports_each_stage_and_its_sends():
    report, _ = pipeline_report()
    assert [(r.rank, r.coordinates) for r in report.ranks] == [
        (0, {"pp": 0, "dp_shard": 0}),
        (8, {"pp": 1, "dp_shard": 0}),
    ]
    first, last = report.ranks
    # two microbatches (the default: one per stage) of one sequence each. Stage 0 sends what stage 1
    # takes: the fp32 hidden states alone (each stage computes its rotary embeddings, positions and
    # causal mask itself: kiln.models.hf_stages), and receives their gradients; stage 1 the same.
    # (Before, the rotary cos and sin and the bool mask crossed too: 2 * (4 + 3) sends.)
    hidden = SEQ * HIDDEN * 4
    assert first.collectives["p2p"] == last.collectives["p2p"] == {"pp": 2 * (hidden + hidden)}
    assert first.calls["p2p"] == {"pp": 2 * (1 + 1)}
    assert first.collectives["broadcast"] == last.collectives["broadcast"] == {"pp": 4}  # the loss, from the last stage
    # FSDP inside a stage keeps its gathered blocks across the microbatches (the default under a
    # pipeline, as torchtitan's): each parameter is gathered once a step, as its gradient is
    # reduce-scattered once; resharding after each forward gathers 3 times as much (a forward and a
    # backward gather per microbatch, 2 microbatches: Hybrid(reshard_after_forward=True)).
    for rank in report.ranks:
        assert rank.collectives["all_gather"]["dp_shard"] == rank.collectives["reduce_scatter"]["dp_shard"]
        assert rank.calls["all_gather"]["dp_shard"] == rank.calls["reduce_scatter"]["dp_shard"] == 2


def test_the_ranks_of_a_pipeline_share_one_trace_and_measure_what_their_own_would():
    # kiln.planning.shared_trace: the first rank's torch.export program, over each later rank's own
    # tensors. Rank 8 measured alone (its own trace) holds and moves what it did on the shared one.
    shared, traces = pipeline_report()
    assert [r.rank for r in shared.ranks] == [0, 8] and traces == 1
    alone = dry_run(load_trainer_args(config(PIPELINE, precision="fp32"), world_size=16), 16, ranks=[8])
    assert alone.ranks[0] == shared.ranks[1]


def test_a_shared_trace_is_over_the_later_modules_own_tensors():
    from kiln.planning.fake_world import fake_tensor_mode
    from kiln.planning.shared_trace import one_trace

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4), persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale + torch.tensor([1.0, 2.0, 3.0, 4.0])  # a lifted constant

    with one_trace() as traces:
        programs = []
        for _ in range(2):
            with fake_tensor_mode() as mode:
                net = Net()
                program = torch.export.export(net, (torch.ones(2, 4),))
                assert program.state_dict["lin.weight"] is net.lin.weight
                assert program.constants["scale"] is net.scale
                assert all(getattr(t, "fake_mode", mode) is mode for t in program.constants.values())
                assert program.module()(torch.ones(2, 4)).shape == (2, 4)  # runs in this rank's mode
                programs.append(program)
    assert traces.counts == {"traced": 1, "shared": 1, "cut": 0, "cut_shared": 0}
    assert programs[1].graph is programs[0].graph


def test_tied_embeddings_are_held_once():
    # Placement made the meta parameters fake one module at a time, which untied the head from the
    # embedding (a second copy the optimizer never saw: Qwen2's tied models measured 1.3-1.45x high).
    (untied,), (tied,) = fsdp8(tied=False).ranks, fsdp8(tied=True).ranks
    embedding = VOCAB * HIDDEN * 4 // 8  # fp32, FSDP's shard of one of 8 ranks
    assert untied.params - tied.params == untied.grads - tied.grads == embedding
    assert untied.optimizer - tied.optimizer == 2 * embedding + 4  # AdamW's two moments, and a step


def test_mesh_dimension_names_the_dimensions_a_group_spans():
    sizes = {"pp": 2, "dp_replicate": 1, "dp_shard": 4, "tp": 2}
    assert mesh_dimension([0, 1], sizes) == "tp"
    assert mesh_dimension([1, 3, 5, 7], sizes) == "dp_shard"
    assert mesh_dimension([6, 14], sizes) == "pp"
    assert mesh_dimension(range(8), sizes) == "dp_shard+tp"
    assert mesh_dimension([5], sizes) == "self"


@pytest.mark.parametrize(
    "world, compute, model, message",
    [
        (
            16,
            {"tp": 8, "dp_shard": -1},
            {"heads": 4, "kv_heads": 4},
            "tensor parallelism over 8 ranks splits the attention 'model.model.layers.0.self_attn' by heads, but "
            "its config has num_attention_heads=4, which 8 does not divide (each rank must hold whole heads); use "
            "a tensor-parallel size in [2, 4], or a plan that leaves the attention whole",
        ),
        (
            16,
            {"tp": 2, "dp_shard": 4},
            {},
            "parallel sizes (pp=1, dp_replicate=1, dp_shard=4, tp=2) multiply to 8 but the world has 16 processes; "
            "make pp*dp_replicate*dp_shard*tp equal 16, or set dp_shard=-1 to let it take the rest",
        ),
        (
            4,
            {"pp": 2, "dp_shard": -1, "strategy_options": {"split_points": ["model.model.embed_tokens"]}},
            {},
            "Pipeline split_points=['model.model.embed_tokens'] gave 1 stages instead of 2: each split point must "
            "be a module the forward calls, listed in the order the forward calls them",
        ),
    ],
    ids=["heads", "mesh-product", "empty-stage"],
)
def test_a_configuration_error_is_the_real_runs_message(world, compute, model, message):
    args = load_trainer_args(config(compute, **model), world_size=world)
    with pytest.raises(ValueError) as raised:
        dry_run(args, world)
    assert str(raised.value) == message


def test_a_size_that_does_not_divide_the_world_is_refused_as_kiln_train_refuses_it():
    with pytest.raises(ConfigError) as raised:
        load_trainer_args(config({"tp": 8}), world_size=12)
    assert str(raised.value) == (
        "compute_config.tp: got 8 (int), expected a divisor of the world size 12 (processes per model replica)"
    )


# -- the command line ---------------------------------------------------------------------------------
def _write(tmp_path: Path, cfg: dict) -> Path:
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_kiln_plan_dry_run_prints_the_report_as_json(plan_json):
    assert plan_json["code"] == 0
    out = plan_json["report"]
    params, _ = closed_form(8, 16, split_vocab=True)  # tp 8 of a Llama: sequence and loss parallel
    assert out["world_size"] == 128 and out["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 16, "tp": 8}
    assert out["ranks"][0]["params"] == params
    assert set(out) == {
        "world_size", "mesh", "strategy", "precision", "activation_checkpointing", "compile", "micro_batch_size",
        "grad_accumulation_steps", "num_parameters", "ranks", "seconds", "notes",
    }  # fmt: skip
    assert set(out["ranks"][0]) == {
        "rank", "coordinates", "params", "grads", "optimizer", "activations", "peak", "collectives", "calls",
        "checkpoint_bytes", "checkpoint_entries",
    }  # fmt: skip
    assert plan_json["files"] == ["run.yaml"]  # nothing written


def test_kiln_plan_dry_run_fails_in_one_line_with_status_2(tmp_path, monkeypatch, capsys):
    from kiln.cli.main import main

    path = _write(tmp_path, config({"tp": 8, "dp_shard": -1}, heads=4, kv_heads=4))
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "-f", str(path), "--world-size", "16", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kiln plan: error: tensor parallelism over 8 ranks splits the attention")
    assert captured.err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_kiln_train_dry_run_runs_the_world_the_run_file_is_for(tmp_path, monkeypatch, capsys):
    from kiln.cli.main import main

    cfg = config({"tp": 8, "dp_shard": -1, "runtime_ngpus": 64})
    cfg["checkpoint"] = {"save_dir": "./runs/checkpoints"}
    path = _write(tmp_path, cfg)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "-f", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    params, _ = closed_form(8, 8, split_vocab=True)
    assert out.startswith("dry run: ") and " on 64 ranks (dp_shard 8 x tp 8);" in out.splitlines()[0]
    assert out.splitlines()[2].split()[:3] == ["0", "dp_shard=0,tp=0", f"{params / 1024:.2f}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no checkpoint folder, no log


def test_a_strategy_that_needs_real_parameter_storage_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from kiln.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # examples.mlp_model
    assert main(["train", "-f", str(ROOT / "examples" / "mlp.yaml"), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        "kiln train: error: compute_config.strategy: 'zero1' cannot be dry-run: it runs on DistributedDataParallel, "
        "which checks and buckets the parameters' data in C++; dry-run the run with strategy fsdp (or a hybrid "
        "mesh), or see its memory with kiln plan (no --dry-run)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_the_activation_count_follows_storage_resizes():
    # FSDP2 frees a block's gathered parameters with storage.resize_(0) and gathers into the same
    # storage again with resize_(n): no tensor op, so the count must see the resizes themselves
    from kiln.cost.activations import _LiveBytes

    gathered = torch.empty(1024)  # made before the count, like a storage FSDP keeps between steps
    gathered.untyped_storage().resize_(0)
    tracker = _LiveBytes([])
    with tracker.watching_resizes():
        for _ in range(2):
            gathered.untyped_storage().resize_(4096)  # gathered for a block's forward
            gathered.untyped_storage().resize_(0)  # freed after it
    assert tracker.events == [(1, 4096), (1, -4096)] * 2
    assert tracker.peak(set()) == 4096


def test_plain_tensor_parallelism_all_reduces_the_norms_gradients_once_a_step():
    # Under TensorParallel (no FSDP) sequence parallelism's norms are Replicate weights applied to
    # sequence shards: their gradients leave the backward as partial sums, summed once a step over
    # tp in one all-reduce after the last backward (kiln.parallel.state.replicated_grads): the 5
    # norms' fp32 gradients, 2 x LAYERS + 1 weights of HIDDEN. Before, DTensor summed them inside
    # each AdamW op that read them (lerp_ once, addcmul_ twice: 15 all-reduces of 512 B), within
    # DTensor's dispatch, where the counter's mode is off: the dry run counted no all-reduce at all.
    # (Loss parallelism's per-token all-reduces run there too and are still not counted.)
    # Hybrid with tp and no FSDP (a run file's `tp: 2`) sums them once too, before the optimizer step.
    for compute in ({"strategy": "tp"}, {"tp": 2, "dp_shard": 1}):
        report = dry_run(load_trainer_args(config(compute), world_size=2), 2)
        (rank,) = report.ranks
        assert rank.collectives["all_reduce"] == {"tp": (2 * LAYERS + 1) * HIDDEN * 4}, compute
        assert rank.calls["all_reduce"] == {"tp": 1}, compute
