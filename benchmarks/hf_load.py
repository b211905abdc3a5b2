"""Each rank's memory through ``HuggingFaceModel.from_pretrained`` under a sharding strategy, against
the model's size.

    python benchmarks/hf_load.py                           # saves a ~1.35 GB Llama, launches 4 ranks (zero3)
    python benchmarks/hf_load.py --strategy pp_fsdp        # Hybrid(pp=2, dp_shard=2): a stage per rank pair
    python benchmarks/hf_load.py --strategy pp_fsdp --whole-before-cut   # for comparison: the whole model before the cut
    python benchmarks/hf_load.py --layers 8 --out result.json

transformers writes a float32 Llama built from a config (random weights; hidden 2048, MLP 5632,
vocabulary 32000, untied head: 337 M parameters with 4 layers, 1.35 GB) with ``save_pretrained``
into several safetensors files (``--shard-size``) in a temporary folder, plus a tiny model of the
same class. The script then launches itself on ``--nproc`` ranks with ``kiln run`` (torchrun
underneath; CPU, gloo). Each rank first loads and trains the tiny model once (imports, allocator
arenas and the first collectives cost what any load costs), then resets its peak resident size
(``/proc/self/clear_refs``) and measures, from ``/proc/self/status``:

* ``load``: through ``kiln.Engine(HuggingFaceModel.from_pretrained(folder), AdamW, strategy)``
  (the meta model, the strategy's steps, each rank reading its own shards);
* ``step``: then one training step (forward, backward, AdamW step) on a batch of 2 x 32 tokens.

For each: the growth of VmHWM (the peak resident size, from VmRSS before) and of RssAnon (the
process's own memory, not the page cache's file pages) in MB (1e6 bytes), beside the model's
size and this rank's share of the parameters. The bytes each rank read from the files are
counted at kiln's reader (``SafetensorsFile.read``). A rank that held the whole model would
grow by at least the model's size at load. The step adds the gradients, AdamW's two moments (twice
the shard) and FSDP's all-gathered blocks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6


def save(folder: Path, args: argparse.Namespace) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(vocab_size=32000, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.mlp, num_hidden_layers=args.layers, **common)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder / "big", max_shard_size=args.shard_size)
    del model
    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, **{**common, "vocab_size": 256})
    LlamaForCausalLM(tiny).save_pretrained(folder / "tiny")


def status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def strategy(name: str, layers: int):
    import torch

    import kiln

    if name == "pp_fsdp":
        example = {"input_ids": torch.zeros(2, 32, dtype=torch.long)}
        return kiln.parallel.Hybrid(
            pp=2,
            dp_shard=2,
            split_points=[f"model.model.layers.{layers // 2}"],
            example_input=example,
            microbatches=2,
        )
    return name


def engine_for(folder: Path, name: str, layers: int):
    import torch

    import kiln
    from kiln.models import HuggingFaceModel

    model = HuggingFaceModel.from_pretrained(str(folder))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = kiln.Engine(model, optimizer, strategy=strategy(name, layers), criterion=model.loss)
    return engine, model


def step(engine, vocab: int) -> float:
    import torch

    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, 32))
    batch = {"input_ids": ids, "labels": ids}
    out = engine(batch)
    loss = engine.criterion(out, batch)
    engine.backward(loss)
    engine.step()
    engine.zero_grad()
    return float(loss)


def worker(args: argparse.Namespace) -> None:
    import kiln
    from kiln.models import hf_weights

    kiln.launch_from_torch(seed=0)
    folder = Path(args.folder)
    read: list[int] = []
    reader = hf_weights.SafetensorsFile.read

    def counted(self, key, box=None):  # kiln's one reader of the files
        value = reader(self, key, box)
        read.append(value.numel() * value.element_size())
        return value

    hf_weights.SafetensorsFile.read = counted
    if args.whole_before_cut:  # kiln before per-stage reads: a pipeline read the whole model before its trace
        from kiln.models import HuggingFaceModel

        HuggingFaceModel.read_weights_per_stage = lambda self: None  # type: ignore[method-assign]
    tiny, _ = engine_for(folder / "tiny", args.strategy, 2)
    step(tiny, 256)
    del tiny
    sizes = {}
    for path in sorted(set(hf_weights.checkpoint_keys(folder / "big").values())):
        file = hf_weights.SafetensorsFile(path)
        sizes.update({k: e["data_offsets"][1] - e["data_offsets"][0] for k, e in file.entries.items()})
        file.close()
    read.clear()
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = status()
    engine, model = engine_for(folder / "big", args.strategy, args.layers)
    loaded = status()
    local = sum(
        p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4 for p in engine.model.parameters()
    )
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before_step = status()
    loss = step(engine, 32000)
    stepped = status()
    report = {
        "rank": kiln.context().rank,
        "strategy": args.strategy + (" (whole before cut)" if args.whole_before_cut else ""),
        "model_MB": round(sum(sizes.values()) / MB, 1),
        "local_params_MB": round(local / MB, 1),
        "read_MB": round(sum(read) / MB, 1),
        "load_hwm_growth_MB": round((loaded["VmHWM"] - before["VmRSS"]) / MB, 1),
        "load_anon_growth_MB": round((loaded["RssAnon"] - before["RssAnon"]) / MB, 1),
        "step_hwm_growth_MB": round((stepped["VmHWM"] - before_step["VmRSS"]) / MB, 1),
        "step_anon_growth_MB": round((stepped["RssAnon"] - before_step["RssAnon"]) / MB, 1),
        "loss": round(loss, 4),
    }
    print("HF_LOAD " + json.dumps(report), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--strategy", default="zero3", help="zero3 | fsdp | pp_fsdp (Hybrid(pp=2, dp_shard=2))")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--mlp", type=int, default=5632)
    p.add_argument("--shard-size", default="300MB", help="save_pretrained's max_shard_size")
    p.add_argument(
        "--whole-before-cut",
        action="store_true",
        help="for comparison: a pipeline reads the whole model before its trace (kiln before per-stage reads)",
    )
    p.add_argument("--folder", default=None, help="(set by the launcher) where the models are")
    p.add_argument("--out", default=None, help="write the ranks' reports as JSON here")
    args, _ = p.parse_known_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    with tempfile.TemporaryDirectory(prefix="kiln-hf-load-") as tmp:
        save(Path(tmp), args)
        files = sorted((Path(tmp) / "big").glob("*.safetensors"))
        print(f"saved {len(files)} files, {sum(f.stat().st_size for f in files) / MB:.0f} MB", flush=True)
        cmd = [sys.executable, "-m", "kiln.cli.main", "run", "-n", str(args.nproc), __file__, *sys.argv[1:]]
        result = subprocess.run([*cmd, "--folder", tmp], env=env, capture_output=True, text=True)
    reports = sorted(
        (json.loads(line[len("HF_LOAD ") :]) for line in result.stdout.splitlines() if line.startswith("HF_LOAD ")),
        key=lambda r: r["rank"],
    )
    if result.returncode or len(reports) != args.nproc:
        sys.stderr.write(result.stderr[-5000:])
        return result.returncode or 1
    columns = list(reports[0])
    print(" | ".join(columns))
    for report in reports:
        print(" | ".join(str(report[c]) for c in columns))
    if args.out:
        Path(args.out).write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
