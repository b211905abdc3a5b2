"""Peak resident memory of ``kiln checkpoint export --hf`` against the model's size.

    python benchmarks/hf_export.py [--hidden 2048] [--layers 12] [--folder /tmp/kiln-hf-export-bench]

A Llama built from a config with random weights (float32; the defaults make ~1.2 GB), saved by a
Trainer as a sharded (DCP) checkpoint, then exported in a fresh process with ``--max-shard-size
500MB``. The export process reports its resident memory after its imports (the baseline) and its
peak (``VmHWM``), each split into anonymous and file-backed pages; the target is a peak growth of at
most the largest single tensor plus one file's read buffer (kiln.checkpoint.hf_export streams one
tensor at a time; the whole model is never in memory). Prints one JSON line.
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
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", _EXPORT, str(checkpoint), str(folder / "hf")], capture_output=True, text=True
    )
    seconds = time.perf_counter() - start
    line = next((x for x in result.stdout.splitlines() if x.startswith("EXPORT ")), None)
    if line is None:
        raise SystemExit(f"export failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    report = json.loads(line[len("EXPORT ") :])
    before, after = report["before"], report["after"]
    files = sorted(p.name for p in (folder / "hf").glob("*.safetensors"))
    print(
        json.dumps(
            {
                "model_bytes": sum(sizes),
                "largest_tensor_bytes": max(sizes),
                "files": len(files),
                "export_seconds": round(seconds, 1),
                "peak_growth_bytes": after["VmHWM"] - before["VmRSS"],
                "anon_growth_end_bytes": after["RssAnon"] - before["RssAnon"],
                "baseline_rss_bytes": before["VmRSS"],
                "peak_over_largest_tensor": round((after["VmHWM"] - before["VmRSS"]) / max(sizes), 2),
                "peak_over_model": round((after["VmHWM"] - before["VmRSS"]) / sum(sizes), 3),
            }
        )
    )
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
