"""The dry run's numbers against real gloo runs of the same configurations on 2 and 4 processes.

The real side (tests/workers/plan_vs_real_worker.py) trains each configuration through the Trainer
``kiln train`` builds and measures it without the dry run's machinery: the storages of parameters,
gradients and optimizer state; the CPU allocator's peak in the forwards and backwards (torch.profiler's
allocation records, the least of three steps; a collective's own copies count as freed when it
returns, since gloo frees them on its own thread, unrecorded and late on a busy machine); the bytes of every collective, counted by wrappers around the
functions of ``torch.distributed`` and ``torch.distributed._functional_collectives``. The dry run
must give the same bytes exactly, activations within 10%, and a configuration error's message.
"""

from __future__ import annotations

import json
import sys

import pytest

from distributed import WORKERS, check, fork_run
from kiln.config.args import load_trainer_args
from kiln.planning.dry_run import dry_run

pytest.importorskip("transformers")
# hf_common, for the dry runs in this process: appended, since a forked rank's start sets sys.path[0]
# to its own script's folder (a first entry would be replaced there)
if str(WORKERS) not in sys.path:
    sys.path.append(str(WORKERS))

TOLERANCE = 0.10


def config(compute: dict, *, precision: str = "amp_bf16", kv_heads: int = 2) -> dict:
    """A small Llama whose activations outweigh one block's gradient buffer (2048 tokens, width 128),
    as a real model's do: the buffers gloo frees late are then a small part of the peak."""
    model = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
    )
    return {
        "compute_config": compute,
        "micro_batch_size": 64,
        "max_train_steps": 1,
        "seed": 0,
        "precision": precision,
        "activation_checkpointing": "full",
        "model": {"type": "kiln.models.HuggingFaceModel.from_config", "args": {"config": model}},
        "optimizer": {"type": "torch.optim.AdamW", "args": {"lr": 1e-3}},
        # byte windows of one stdlib module's source (examples' lm_data.StdlibText walks the whole
        # standard library folder, site-packages included, each time it is built: 17% of a rank's CPU)
        "dataset": {"type": "hf_common.ByteWindows", "train_args": {"count": 256, "seq": 32}},
        "checkpoint": {"no_save": True},
        "enable_progress_bar": False,
    }


# The configurations the real run must refuse, with what the refusal names; every other one must
# run and be compared (a configuration failing on both sides for the same reason, an import of
# the dataset say, would otherwise pass comparing nothing).
REFUSED = {"kv_heads": "num_key_value_heads=1"}

PIPELINE = {"pp": 2, "dp_shard": -1, "strategy_options": {"split_points": ["model.model.layers.1"]}}
WORLDS = {
    2: {
        "fsdp": config({"strategy": "fsdp"}),
        "kv_heads": config({"tp": 2}, kv_heads=1),  # tensor parallelism of 2 cannot split 1 key/value head
    },
    4: {
        # tensor parallelism without sequence parallelism: the real side's counters wrap the
        # functions of torch.distributed and _functional_collectives, which DTensor's sequence-shard
        # redistributions do not all go through (the dry run counts those at the ops: test_dry_run)
        "fsdp_tp": config({"tp": 2, "dp_shard": -1, "sequence_parallel": False}),
        "pp_fsdp": config(PIPELINE, precision="fp32"),
    },
}


@pytest.mark.parametrize(
    "world",
    [
        pytest.param(2, marks=pytest.mark.world_size(2)),
        pytest.param(4, marks=[pytest.mark.world_size(4), pytest.mark.slow]),
    ],
)
def test_the_dry_run_is_what_a_real_run_allocates_and_moves(world, tmp_path):
    configs = WORLDS[world]
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    check(
        fork_run(
            WORKERS / "plan_vs_real_worker.py",
            str(tmp_path / "configs.json"),
            str(tmp_path),
            nproc=world,
            timeout=400,
            cwd=tmp_path,
        )
    )
    for name, cfg in configs.items():
        real = {r: json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(world)}
        args = load_trainer_args(cfg, world_size=world)
        if name not in REFUSED:
            assert "error" not in real[0], f"{name} did not run: {real[0]['error']}"
        else:
            assert REFUSED[name] in real[0].get("error", ""), f"{name} was not refused as expected: {real[0]}"
            assert real[0] == real[world - 1]
            with pytest.raises(ValueError) as raised:
                dry_run(args, world)
            assert str(raised.value) == real[0]["error"]
            continue
        report = dry_run(args, world, ranks=[0, world - 1])  # the first and last coordinates of the mesh
        for rank in report.ranks:
            measured = real[rank.rank]
            where = f"{name}, rank {rank.rank}"
            assert (rank.params, rank.grads, rank.optimizer) == (
                measured["params"],
                measured["grads"],
                measured["optimizer"],
            ), where
            assert measured["same_collectives_every_step"], where
            assert rank.collectives == measured["collectives"], where
            assert abs(rank.activations - measured["activations"]) <= TOLERANCE * measured["activations"], (
                f"{where}: dry run {rank.activations} B, real {measured['activation_peaks']} B"
            )
