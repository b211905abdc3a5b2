"""Hugging Face streaming datasets (``load_dataset("text", data_files=..., streaming=True)`` over
local files) resume exactly through the ResumableLoader's stream state, split by rank.

End to end on 2 ranks (tests/workers/stream_trainer.py ``--data hf``): the Trainer splits the
stream over the ranks (``datasets.distributed.split_dataset_by_node``) and reads it through a
StatefulDataLoader with 2 workers; SIGKILLed mid-epoch and autoresumed, each rank trains the
uninterrupted run's batches, fetches nothing it had trained before the checkpoint and nothing
twice, and ends with bit-exact weights.
"""

from __future__ import annotations

import io
import signal
import warnings
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

import kiln
from distributed import WORKERS, ForkedRank, base_env, free_port
from kiln.launch.streaming import shard_by_rank, with_sharded_stream

datasets = pytest.importorskip("datasets")
pytest.importorskip("torchdata.stateful_dataloader")

RUN = WORKERS / "stream_trainer.py"
NUM_FILES, LINES = 4, 12  # 48 samples: 2 files (24 samples, 6 batches of 4) per rank


def _write_text(folder) -> list[str]:
    """Text files whose lines are the sample ids: file f holds 100 f .. 100 f + 11."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(NUM_FILES):
        path = folder / f"part{f}.txt"
        path.write_text("".join(f"{100 * f + i}\n" for i in range(LINES)))
        files.append(str(path))
    return files


def _stream(files):
    return datasets.load_dataset("text", data_files=files, split="train", streaming=True)


def _collate(rows):
    return torch.tensor([int(row["text"]) for row in rows])


def _through_bytes(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_rank_share_resumes_exactly_in_this_process(tmp_path):
    files = _write_text(tmp_path / "text")

    def loader(rank):  # no workers: the ResumableLoader asks the dataset itself for its state
        return kiln.ResumableLoader(
            DataLoader(shard_by_rank(_stream(files), 2, rank), batch_size=4, collate_fn=_collate)
        )

    for rank in range(2):
        full = loader(rank)
        epoch0 = [b.tolist() for b in full]
        assert len(epoch0) == 6 and all(i // 100 in (rank, rank + 2) for b in epoch0 for i in b)  # whole files
        part = loader(rank)
        iterator = iter(part)
        next(iterator), next(iterator)
        saved = _through_bytes(part.state_dict())
        resumed = loader(rank)
        resumed.load_state_dict(saved)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the stream's state: nothing fetched again, no replay warning
            assert [b.tolist() for b in resumed] == epoch0[2:]

    plain = DataLoader(_stream(files), batch_size=4, collate_fn=_collate)
    sharded = with_sharded_stream(plain, 2, 1)
    assert sharded is not plain and with_sharded_stream(sharded, 2, 1) is sharded  # split once
    assert with_sharded_stream(plain, 1, 0) is plain
    assert sorted(i for b in sharded for i in b.tolist()) == [100 + i for i in range(12)] + [300 + i for i in range(12)]


# -- end to end on 2 ranks -----------------------------------------------------------------------
def _start(port, *runs) -> list[ForkedRank]:
    """The 2 ranks, forked from the tests' warm server (tests/distributed.py: no fresh interpreter's
    torch, kiln and datasets imports) and started directly (no torchrun agent), training ``runs``
    (each ``(out, tag, *args)``) one after another; a SIGKILL at the same batch start on both needs
    no agent to end the other rank. Their output goes to the last run's ``log_<tag>_rank<r>.txt``
    (stderr) and ``.out`` (stdout)."""
    cmd = [str(RUN)]
    for i, (out, tag, *args) in enumerate(runs):
        _write_text(out / "text")
        cmd += [*(["--then"] if i else []), str(out), "--data", "hf", "--epochs", "1", "--save-at", "2"]
        cmd += ["--tag", tag, *args]
    procs = []
    for rank in range(2):
        env = {**base_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = out / f"log_{tag}_rank{rank}"
        procs.append(ForkedRank(cmd, env, log.with_suffix(".out"), log.with_suffix(".txt")))
    return procs


def _wait(procs) -> list[int | None]:
    try:
        return [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)


def _logs(out, tag) -> str:
    return "\n".join((out / f"log_{tag}_rank{r}.txt").read_text()[-2000:] for r in range(2))


def _trained(out, tag, rank) -> dict[int, list[int]]:
    path = out / f"trained_{tag}_rank{rank}.txt"
    if not path.exists():
        return {}
    return {int(b): [int(i) for i in ids] for b, *ids in (line.split() for line in path.read_text().splitlines())}


def _fetched(out, tag, rank) -> list[int]:
    path = out / f"fetched_{tag}_rank{rank}.txt"
    return [int(line.split()[1]) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_streaming_text_dataset_killed_mid_epoch_resumes_exactly_on_two_ranks(tmp_path):
    # the uninterrupted run, then in the same processes one that saves after batch 2 and is
    # SIGKILLed as batch 5 starts
    full_out, out = tmp_path / "full", tmp_path / "run"
    codes = _wait(_start(free_port(), (full_out, "full"), (out, "a0", "--kill-at", "4")))
    assert codes == [-signal.SIGKILL] * 2, _logs(out, "a0")
    missing = [r for r in range(2) if not (full_out / f"final_full_rank{r}.pt").exists()]
    assert not missing, f"the uninterrupted run did not finish on ranks {missing}:\n{_logs(out, 'a0')}"
    assert _wait(_start(free_port(), (out, "a1", "--autoresume"))) == [0, 0], _logs(out, "a1")
    full = [_trained(full_out, "full", rank) for rank in range(2)]
    assert [len(f) for f in full] == [6, 6]
    seen = [sorted(i for ids in f.values() for i in ids) for f in full]
    assert sorted(seen[0] + seen[1]) == sorted(100 * f + i for f in range(NUM_FILES) for i in range(LINES))
    for rank in range(2):
        # SIGKILL at the start of batch 5: 4 batches trained
        assert _trained(out, "a0", rank) == {b: full[rank][b] for b in range(1, 5)}
        assert _trained(out, "a1", rank) == {b: full[rank][b] for b in range(3, 7)}  # from the checkpoint
        fetched = _fetched(out, "a1", rank)
        assert not [i for i, n in Counter(fetched).items() if n > 1], f"rank {rank} fetched samples twice"
        before = {i for b in (1, 2) for i in full[rank][b]}
        assert not before & set(fetched), f"rank {rank} fetched samples trained before its checkpoint"
        assert sorted(fetched) == sorted(i for b in range(3, 7) for i in full[rank][b])  # exactly the rest
        final, resumed = (
            torch.load(d / f"final_{t}_rank{rank}.pt", weights_only=True) for d, t in ((full_out, "full"), (out, "a1"))
        )
        assert resumed["loader"] == "StatefulDataLoader"
        for name, tensor in final["model"].items():
            assert torch.equal(tensor, resumed["model"][name]), f"rank {rank}: {name}"
