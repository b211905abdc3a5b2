"""A pipeline's stages compute, send and receive in the dtype they compute in, not their storage's.

Under ``amp_bf16`` with FSDP inside the stages, FSDP gathers each stage's parameters in bfloat16,
so the model run eagerly carries a bfloat16 residual stream and bfloat16 gradients. A pipeline
traced in the parameters' float32 baked float32 into the stages (an RMSNorm casts back to the
traced input's dtype) and into the buffers between them: twice the bytes on every send, and
float32 input gradients (and tensor-parallel reduce-scatters) inside each stage. The model is now
traced in FSDP's dtype (``PipelineRuntime(trace_dtype=...)``); without FSDP the stages run on
float32 parameters under autocast, whose eager residual stream is float32, and so does the trace.

Measured in a dry run (a tiny Llama, 16 tokens of width 32 per microbatch, 4 microbatches, 1F1B on
2 stages): under FSDP the first stage sends each microbatch's hidden states and receives their
gradient, 8 x 16 x 32 x 2 = 8,192 B a step in bfloat16 (16,384 B before: float32), checked on
tests/test_dry_run_steady.py's dry run of that plan. Without FSDP (2 ranks, here) the same step
stays 16,384 B. The real-process side (the dtypes gloo's sends and receives carry, and the losses
against autocast) is in tests/test_pipeline_zero_bubble.py. Broken on purpose: with no trace
dtype (``trace_dtype=None`` in kiln.parallel.pipeline), the FSDP case measures 16,384 B; with the
trace dtype taken whether or not FSDP shards the stages, this test measures 8,192 B.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

from kiln.config.args import load_trainer_args
from kiln.planning.dry_run import dry_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # lm_data

pytest.importorskip("transformers")

TOKENS, HIDDEN, MICROBATCHES = 16, 32, 4


@pytest.fixture(scope="module", autouse=True)
def _stdlib_read_once():
    """lm_data's text of the standard library walks the whole stdlib tree each time: read once."""
    import lm_data

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_data, "stdlib_bytes", functools.cache(lm_data.stdlib_bytes))
        yield


def _p2p(compute: dict) -> int:
    model = dict(
        model_type="llama", vocab_size=128, hidden_size=HIDDEN, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    run = {
        "compute_config": {
            **compute,
            "strategy_options": {"microbatches": MICROBATCHES, "split_points": ["model.model.layers.1"]},
        },
        "micro_batch_size": MICROBATCHES,
        "max_train_steps": 1,
        "precision": "amp_bf16",
        "model": {"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": model}},
        "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 1e-3}},
        "dataset": {"type": "lm_data.StdlibText.from_stdlib", "train_args": {"seq_len": TOKENS, "max_bytes": 20000}},
    }
    world = compute["pp"] * compute.get("dp_shard", 1)
    row = dry_run(load_trainer_args(run, world_size=world), world, ranks=[0], workers=1).to_dict()["ranks"][0]
    return row["collectives"]["p2p"]["pp"]


def test_stages_without_fsdp_keep_the_float32_stream_of_autocast():
    # each microbatch's hidden states out, their gradient back in: 2 tensors of TOKENS x HIDDEN
    assert _p2p({"strategy": "hybrid", "pp": 2}) == MICROBATCHES * 2 * TOKENS * HIDDEN * 4
