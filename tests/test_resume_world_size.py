"""A run checkpointed mid-epoch on one world size and resumed on another trains on every sample of
that epoch that it had not seen, once (plus DistributedSampler's usual padding), and on nothing it
had seen. On the same world size the order is the uninterrupted one (tests/test_checkpoint_*)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from distributed import WORKERS, check, fork_run

RUN = WORKERS / "world_change.py"


def _seen(out, attempt, world):
    pairs = [p for r in range(world) for p in json.loads((out / f"seen_rank{r}_{attempt}.json").read_text())]
    return Counter(i for e, i in pairs if e == 0), Counter(i for e, i in pairs if e == 1)


# (first world, then world) -> (die after, consumed, padding)
CASES = {
    (2, 1): (4, 18, 0),  # 2 ranks x 3 batches x 3 samples consumed; the rest (32) on one rank
    (1, 2): (4, 9, 1),  # 9 consumed: the other 41 dealt over 2 ranks, padded with one repeat
}


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """Both cases' runs in 3 launches rather than 4: 1 rank dies; 2 ranks resume it, then (same
    processes) start the other case and die; 1 rank resumes that. Returns each case's folder."""
    root = tmp_path_factory.mktemp("world_change")
    out = {case: root / f"{case[0]}-to-{case[1]}" for case in CASES}
    up, down = out[1, 2], out[2, 1]
    for folder in out.values():
        folder.mkdir()

    def died(result, folder):
        assert result.returncode != 0, f"{folder.name}: the first attempt should have died"
        assert (folder / "ckpt/last").resolve().name == "ep0-ba3"

    died(fork_run(RUN, str(up), "--die-after", str(CASES[1, 2][0]), nproc=1), up)
    result = fork_run(RUN, str(up), "--autoresume", "--then", str(down), "--die-after", str(CASES[2, 1][0]), nproc=2)
    assert (up / "seen_rank1_resumed.json").exists(), f"the 2-rank resume did not run:\n{result.stderr[-3000:]}"
    died(result, down)
    check(fork_run(RUN, str(down), "--autoresume", nproc=1))
    return out


@pytest.mark.world_size(2)
@pytest.mark.parametrize("first, then", list(CASES), ids=["2-to-1-rank", "1-to-2-ranks"])
def test_resume_on_another_world_size_covers_the_epoch_once(resumed_runs, first, then):
    tmp_path = resumed_runs[first, then]
    _, consumed, padding = CASES[first, then]
    before, _ = _seen(tmp_path, "first", first)
    after, next_epoch = _seen(tmp_path, "resumed", then)
    # the first run's batch after the checkpoint (batch 4) is lost with the crash: count what the
    # checkpoint recorded, the first 3 batches
    first_pairs = [json.loads((tmp_path / f"seen_rank{r}_first.json").read_text()) for r in range(first)]
    checkpointed = Counter(i for pairs in first_pairs for e, i in pairs[:9])
    assert sum(checkpointed.values()) == consumed
    assert not set(checkpointed) & set(after), "a sample seen before the checkpoint came again"
    assert set(checkpointed) | set(after) == set(range(50))
    assert sum(after.values()) == 50 - consumed + padding
    # the next epoch is a whole one on the new world (50 samples, padded to a multiple of it)
    assert set(next_epoch) == set(range(50)) and sum(next_epoch.values()) == 50 + (-50) % then
    assert before  # the first attempt trained before it died
