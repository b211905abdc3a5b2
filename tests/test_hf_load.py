"""``HuggingFaceModel.from_pretrained`` reads each rank's own shards after the strategy sharded the
meta model (kiln.models.hf_weights), equal to transformers' ``from_pretrained`` to the bit.

transformers writes the tiny models with ``save_pretrained(..., max_shard_size="20KB")``: several
safetensors files and ``model.safetensors.index.json``. Llama (untied), Qwen2 (tied embeddings),
Mixtral (per-expert files fused into one weight on load) and a bf16 Llama (the dtype from the
config) are compared under single, ddp, zero3, tp (sequence and loss parallel, kiln's default for
the Llama family), fsdp x tp (``Hybrid(dp_shard=2, tp=2)``) and a 2-stage pipeline, alone and with
FSDP in each stage (tests/workers/hf_load_worker.py), where each rank must have read only its own
stage's weights from the files (its shards of them), counted to the byte; the Mixtral under
expert parallelism (``Hybrid(dp_shard=2, ep=2)``), where each rank must have read its own experts'
tensors from the files and no other expert's.
One launch per world size runs every case of that size (a launch costs more than the loads): the
2-rank one, which the 2-rank tests read, is a module fixture.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from distributed import fork_run  # noqa: E402

WORKER = Path(__file__).parent / "workers" / "hf_load_worker.py"
MODELS = ("llama", "qwen2", "mixtral", "llama_bf16")
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(out / "llama", max_shard_size="20KB")
    Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True)).save_pretrained(
        out / "qwen2", max_shard_size="20KB"
    )
    MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)).save_pretrained(
        out / "mixtral", max_shard_size="20KB"
    )
    LlamaForCausalLM(LlamaConfig(**COMMON)).to(torch.bfloat16).save_pretrained(
        out / "llama_bf16", max_shard_size="20KB"
    )
    for name in ("llama", "qwen2", "mixtral", "llama_bf16"):
        assert (out / name / "model.safetensors.index.json").is_file()
        assert len(list((out / name).glob("*.safetensors"))) > 2
    return out


def _passed(result: subprocess.CompletedProcess, strategy: str, ranks: int, names: tuple[str, ...] = MODELS) -> None:
    assert result.returncode == 0, result.stderr[-5000:]
    for name in names:
        assert result.stdout.count(f"OK {name} {strategy} ") == ranks, result.stdout


def test_single_process(saved: Path) -> None:
    _passed(fork_run(WORKER, str(saved), "single", nproc=1, timeout=240), "single", 1)


@pytest.fixture(scope="module")
def two_ranks(saved: Path) -> subprocess.CompletedProcess:
    """ddp, zero3, tp, ep (the Mixtral) and the pipeline (the Llama family), in one 2-rank launch."""
    # a pipeline traces each model (slow on a CPU): the untied and the tied-embedding Llama family
    cases = ("ddp", "zero3", "tp", "ep:mixtral", "pp:" + "+".join(PIPELINE_MODELS))
    return fork_run(WORKER, str(saved), *cases, nproc=2, timeout=300)


PIPELINE_MODELS = ("llama", "qwen2")


def test_two_ranks(two_ranks: subprocess.CompletedProcess) -> None:
    """ddp, zero3 and tp; the transformers Mixtral under ``Hybrid(dp_shard=2, ep=2)``: its fused
    experts split over ep (kiln.parallel.transforms.hf_expert_parallel), equal to transformers'
    from_pretrained to the bit, each rank having read from the files its own two experts' tensors
    (per-expert w1/w2/w3, fused on load), each whole, and no other expert's."""
    result = two_ranks
    for strategy in ("ddp", "zero3", "tp"):
        _passed(result, strategy, 2)
    _passed(result, "ep", 2, ("mixtral",))
    experts = re.findall(r"^OK mixtral ep \d+ tensors experts (.*)$", result.stdout, re.M)
    assert sorted(experts) == ["0,1", "2,3"], result.stdout


def _stage_reads(result: subprocess.CompletedProcess, name: str, strategy: str) -> list[tuple[int, int]]:
    """(bytes read, bytes of the whole model's files) of each rank under a pipeline."""
    found = re.findall(rf"^OK {name} {strategy} \d+ tensors read (\d+) of (\d+) bytes$", result.stdout, re.M)
    return [(int(read), int(total)) for read, total in found]


def test_pipeline_two_stages(two_ranks: subprocess.CompletedProcess) -> None:
    """Each pipeline rank reads its own stage's weights from the files and no more (the worker checks
    each rank's count to the byte against its stage's tensors): the two ranks' reads add up to the
    files, plus, with tied embeddings, the last stage's head, which reads the embedding again."""
    _passed(two_ranks, "pp", 2, PIPELINE_MODELS)
    for name in PIPELINE_MODELS:
        reads = _stage_reads(two_ranks, name, "pp")
        assert len(reads) == 2, two_ranks.stdout
        total = reads[0][1]
        assert all(read < 0.7 * total for read, _ in reads), reads
        embedding = COMMON["vocab_size"] * COMMON["hidden_size"] * 4  # float32
        assert sum(read for read, _ in reads) == total + (embedding if name == "qwen2" else 0), reads


def test_four_ranks(saved: Path, tmp_path: Path) -> None:
    """One launch of 4 ranks: every model under ``Hybrid(dp_shard=2, tp=2)`` (FSDP shards the
    tensor-parallel DTensors again; each rank reads a quarter of a split weight), the tied Qwen2
    under ``Hybrid(pp=2, dp_shard=2)`` (each rank reads its shards of its stage), and, first, each
    rank's peak resident growth (VmHWM, and RssAnon) through a zero3 load of a ~8 MB Llama stays
    well below the model's size (each rank's shard is a quarter)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **{
            **COMMON,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 4,
            "vocab_size": 512,
            "num_attention_heads": 4,
        }
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "big", max_shard_size="1MB")
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(tmp_path / "warm")
    for name in MODELS:
        (tmp_path / name).symlink_to(saved / name)
    result = fork_run(WORKER, str(tmp_path), "memory", "hybrid", "pp_fsdp:qwen2", nproc=4, timeout=240)
    _passed(result, "hybrid", 4)
    # Hybrid(pp=2, dp_shard=2): each rank reads half of its stage, a quarter of the model
    _passed(result, "pp_fsdp", 4, ("qwen2",))
    reads = _stage_reads(result, "qwen2", "pp_fsdp")
    assert len(reads) == 4 and all(read < 0.4 * total for read, total in reads), reads
    reports = [json.loads(m) for m in re.findall(r"^MEMORY (.*)$", result.stdout, re.M)]
    assert len(reports) == 4, result.stdout
    for report in reports:
        print(report)
        assert report["model_bytes"] > 7_000_000
        assert report["hwm_growth"] < 0.4 * report["model_bytes"], report
        assert report["anon_growth"] < 0.4 * report["model_bytes"], report
