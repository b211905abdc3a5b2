"""Fuzz: flipped bytes and truncated files in every file of a sharded, a deduped and a merged checkpoint.

A mutation changes one file: one byte XORed with a random non-zero value, or the file cut at a
random length; half the positions anywhere, half within 512 bytes of either end (zip headers and
directories, pickles). Each mutated checkpoint is loaded in this process with ``load_checkpoint``
and checked with ``verify_checkpoint``. What must happen:

* **checksums kept** (the manifest as saved): every mutation raises CheckpointError naming the
  file, from both. Sizes and checksums catch it before anything is unpickled.
* **checksums rewritten** (sizes and checksums recomputed to match the mutated file, so only the
  loader can tell):

  - a truncation raises CheckpointError naming the file: it is always structural damage;
  - a flip raises CheckpointError naming the file, or loads. A flip in a tensor's bytes, or in a
    value that still unpickles (a number in a pickle, a date in a zip header), legitimately loads
    different content; only the checksum can tell, and that is what the first mode checks.
    ``verify_checkpoint`` unpickles the pickles but reads no tensor, so it may pass where
    loading fails.

* **manifest.json** (the root of the checksums, so no "rewritten" mode): every mutation raises
  CheckpointError naming manifest.json, or leaves its parsed content the same (a change of white
  space, or of the name of its own checksum field).

In every case nothing else may happen: no other exception, no crash, no hang (a timeout guards).
``KILN_FUZZ_SEED=<int>`` replays a run; otherwise the seed is new each run, printed, and in every
failure message.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from collections import Counter

import pytest

from kiln.checkpoint import CheckpointError, layout, load_checkpoint, save_checkpoint, verify_checkpoint
from workers.ckpt_common import build_state, train
from workers.ckpt_tamper import rehash

NUM_FLIPS, NUM_CUTS = 24, 6  # per file and mode; each run draws new positions (a new seed)
EDGE = 512


def _seed(salt: str) -> tuple[int, random.Random]:
    """(the seed to replay with, an RNG of its own for this test)."""
    base = int(os.environ.get("KILN_FUZZ_SEED", time.time_ns() % 1_000_000))
    print(f"KILN_FUZZ_SEED={base} ({salt})")
    return base, random.Random(f"{base} {salt}")


def _position(rng: random.Random, size: int) -> int:
    if rng.random() < 0.5:
        return rng.randrange(size)
    near = rng.randrange(min(size, EDGE))
    return near if rng.random() < 0.5 else size - 1 - near


def _mutations(rng: random.Random, size: int, num_flips: int = NUM_FLIPS, num_cuts: int = NUM_CUTS):
    """(description, function from the file's bytes to the mutated bytes)."""
    for _ in range(num_flips):
        at, xor = _position(rng, size), rng.randrange(1, 256)
        yield (
            f"flip byte {at} of {size} ^ {xor:#04x}",
            lambda b, at=at, xor=xor: b[:at] + bytes([b[at] ^ xor]) + b[at + 1 :],
        )
    for _ in range(num_cuts):
        at = _position(rng, size)
        yield f"truncate to {at} of {size} bytes", lambda b, at=at: b[:at]


def _attempt(fn) -> BaseException | None:
    """Run fn; the exception it raised (None if it returned). Anything but a CheckpointError fails the test."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except CheckpointError as exc:
        return exc
    return None


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One checkpoint of each save type, saved from the same trained state."""
    folder = tmp_path_factory.mktemp("pristine")
    state = build_state()
    train(state, 3)
    return {
        save_type: save_checkpoint(folder / save_type, state, save_type)
        for save_type in ("sharded", "deduped", "merged")
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["checksums kept", "checksums rewritten"])
@pytest.mark.parametrize("save_type", ["sharded", "deduped", "merged"])
def test_mutated_files_give_one_checkpoint_error_naming_the_file(pristine, tmp_path, save_type, mode):
    seed, rng = _seed(f"{save_type}, {mode}")
    path = shutil.copytree(pristine[save_type], tmp_path / pristine[save_type].name)
    manifest_bytes = (path / layout.MANIFEST).read_bytes()
    outcomes: Counter[str] = Counter()
    # One State to load into (building one costs more than the load): the values a failed load
    # may have left do not change how the next load reads the files; a load that went through
    # (different content) is followed by a new State all the same.
    fresh = build_state(seed=1)
    for name in layout.list_files(path):
        original = (path / name).read_bytes()
        for what, mutate in _mutations(rng, len(original)):
            where = f"KILN_FUZZ_SEED={seed}, {save_type}/{name}: {what} ({mode})"
            (path / name).write_bytes(mutate(original))
            if mode == "checksums rewritten":
                rehash(path)
            loaded = _attempt(lambda state=fresh: load_checkpoint(path, state))
            if loaded is None:
                fresh = build_state(seed=1)
            verified = _attempt(lambda: verify_checkpoint(path))
            must_raise = mode == "checksums kept" or what.startswith("truncate")
            for error, action in ((loaded, "load_checkpoint"), (verified, "verify_checkpoint")):
                if error is None:
                    assert not must_raise or (action == "verify_checkpoint" and mode != "checksums kept"), (
                        f"{where}: {action} accepted it"
                    )
                else:  # a damaged .metadata can make a .distcp entry unreadable: that error names both
                    assert name in str(error), f"{where}: {action} blamed another file: {error}"
            outcomes[f"{name} {what.split()[0]} {'raised' if loaded else 'loaded'}"] += 1
            (path / name).write_bytes(original)
            (path / layout.MANIFEST).write_bytes(manifest_bytes)
    print(f"{sum(outcomes.values())} mutations: {dict(sorted(outcomes.items()))}")
    verify_checkpoint(path)  # restored: the checkpoint is whole again


@pytest.mark.timeout(60)
def test_mutated_manifests_give_one_checkpoint_error_naming_it(pristine, tmp_path):
    seed, rng = _seed("manifest.json")
    outcomes: Counter[str] = Counter()
    fresh = build_state(seed=1)  # as above: a new one only after a load that went through
    for save_type, source in pristine.items():
        path = shutil.copytree(source, tmp_path / save_type)
        original = (path / layout.MANIFEST).read_bytes()
        content = json.loads(original)
        for what, mutate in _mutations(rng, len(original), num_flips=24, num_cuts=6):
            where = f"KILN_FUZZ_SEED={seed}, {save_type}/manifest.json: {what}"
            mutated = mutate(original)
            (path / layout.MANIFEST).write_bytes(mutated)
            for action, fn in (
                ("load_checkpoint", lambda p=path, state=fresh: load_checkpoint(p, state)),
                ("verify_checkpoint", lambda p=path: verify_checkpoint(p)),
            ):
                error = _attempt(fn)
                if error is None and action == "load_checkpoint":
                    fresh = build_state(seed=1)
                if error is None:
                    same = json.loads(mutated)  # it loaded, so it parses: it must say what the original says
                    same = {k: v for k, v in same.items() if k in content}
                    assert same == {k: v for k, v in content.items() if k in same or k != layout.MANIFEST_CHECKSUM}, (
                        f"{where}: {action} accepted a manifest whose content changed"
                    )
                else:
                    assert error.path.endswith(layout.MANIFEST), f"{where}: {action} blamed another file: {error}"
            outcomes[f"{what.split()[0]} {'raised' if error else 'loaded'}"] += 1
        (path / layout.MANIFEST).write_bytes(original)
    print(f"{sum(outcomes.values())} mutations: {dict(sorted(outcomes.items()))}")
