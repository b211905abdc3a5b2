"""Peak resident memory of ``kiln checkpoint export --hf``, and of loading its folder back, against the model's size.

    python benchmarks/hf_export.py [--hidden 2048] [--layers 12] [--folder /tmp/kiln-hf-export-bench]

A Llama built from a config with random weights (float32; the defaults make 2.54 GB, the largest
tensor the 262 MB embedding), saved by a Trainer as a sharded (DCP) checkpoint, then exported in a
fresh process with ``--max-shard-size 500MB``. The export process reports its resident memory after
its imports (the baseline) and its peak (``VmHWM``), and its anonymous memory (``RssAnon``); the
target is a peak growth of at most the largest single tensor plus one file's read buffer
(kiln.checkpoint.hf_export streams one tensor at a time; the checksum check before it maps one
16 MB window of a file at a time). A second fresh process loads the exported folder with
``HuggingFaceModel.from_pretrained`` into a one-process Engine (kiln.models.hf_weights reads each
tensor by byte ranges into the model's own storage): its peak growth against the model's size.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

_EXPORT = r"""
import json, sys
from pathlib import Path
def status():
    return {k: int(v.split()[0]) * 1024 for k, _, v in (l.partition(":") for l in Path("/proc/self/status").read_text().splitlines()) if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
import torch, kiln.checkpoint.export, kiln.checkpoint.hf_export, kiln.models.hf_folder  # the imports, before the baseline
Path("/proc/self/clear_refs").write_text("5")
before = status()
from kiln.cli.main import main
code = main(["checkpoint", "export", sys.argv[1], "--hf", sys.argv[2], "--max-shard-size", "500MB"])
after = status()
print("EXPORT " + json.dumps({"code": code, "before": before, "after": after}))
"""

_LOAD = r"""
import json, sys
from pathlib import Path
def status():
    return {k: int(v.split()[0]) * 1024 for k, _, v in (l.partition(":") for l in Path("/proc/self/status").read_text().splitlines()) if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
import torch, transformers, kiln
from kiln.models import HuggingFaceModel
import transformers.models.llama.modeling_llama  # the imports, before the baseline
Path("/proc/self/clear_refs").write_text("5")
before = status()
engine = kiln.Engine(HuggingFaceModel.from_pretrained(sys.argv[1]), strategy="single")
after = status()
print("LOAD " + json.dumps({"before": before, "after": after}))
"""


def _measure(script: str, tag: str, *argv: str) -> tuple[dict, float]:
    """Run ``script`` in a fresh python; its ``TAG {json}`` line, and the seconds it took."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    line = next((x for x in result.stdout.splitlines() if x.startswith(tag + " ")), None)
    if line is None:
        raise SystemExit(f"{tag.lower()} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(line[len(tag) + 1 :]), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--folder", default="/tmp/kiln-hf-export-bench")
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import kiln
    from kiln.models import HuggingFaceModel

    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = HuggingFaceModel(LlamaForCausalLM(config))
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    trainer = kiln.Trainer(model, save_folder=str(folder / "ck"), progress_bar=False)
    trainer.save_checkpoint()
    del trainer, model
    checkpoint = folder / "ck" / "last"
    report, seconds = _measure(_EXPORT, "EXPORT", str(checkpoint), str(folder / "hf"))
    before, after = report["before"], report["after"]
    files = sorted(p.name for p in (folder / "hf").glob("*.safetensors"))
    load, load_seconds = _measure(_LOAD, "LOAD", str(folder / "hf"))
    peak, load_peak = after["VmHWM"] - before["VmRSS"], load["after"]["VmHWM"] - load["before"]["VmRSS"]
    print(
        json.dumps(
            {
                "model_bytes": sum(sizes),
                "largest_tensor_bytes": max(sizes),
                "files": len(files),
                "export_seconds": round(seconds, 1),
                "peak_growth_bytes": peak,
                "anon_growth_end_bytes": after["RssAnon"] - before["RssAnon"],
                "baseline_rss_bytes": before["VmRSS"],
                "peak_over_largest_tensor": round(peak / max(sizes), 2),
                "peak_over_model": round(peak / sum(sizes), 3),
                "load_seconds": round(load_seconds, 1),
                "load_peak_growth_bytes": load_peak,
                "load_anon_growth_end_bytes": load["after"]["RssAnon"] - load["before"]["RssAnon"],
                "load_peak_over_model": round(load_peak / sum(sizes), 3),
            }
        )
    )
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
