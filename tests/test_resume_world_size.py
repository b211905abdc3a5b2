"""A run checkpointed mid-epoch on one world size and resumed on another trains on every sample of
that epoch that it had not seen, once (plus DistributedSampler's usual padding), and on nothing it
had seen. On the same world size the order is the uninterrupted one (tests/test_checkpoint_*)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from distributed import WORKERS, check, kiln_run

RUN = WORKERS / "world_change.py"


def _seen(out, attempt, world):
    pairs = [p for r in range(world) for p in json.loads((out / f"seen_rank{r}_{attempt}.json").read_text())]
    return Counter(i for e, i in pairs if e == 0), Counter(i for e, i in pairs if e == 1)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "first, then, die_after, consumed, padding",
    [
        (2, 1, 4, 18, 0),  # 2 ranks x 3 batches x 3 samples consumed; the rest (32) on one rank
        (1, 2, 4, 9, 1),  # 9 consumed: the other 41 dealt over 2 ranks, padded with one repeat
    ],
    ids=["2-to-1-rank", "1-to-2-ranks"],
)
def test_resume_on_another_world_size_covers_the_epoch_once(tmp_path, first, then, die_after, consumed, padding):
    died = kiln_run(RUN, str(tmp_path), "--die-after", str(die_after), nproc=first)
    assert died.returncode != 0
    assert (tmp_path / "ckpt/last").resolve().name == "ep0-ba3"
    check(kiln_run(RUN, str(tmp_path), "--autoresume", nproc=then))
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
