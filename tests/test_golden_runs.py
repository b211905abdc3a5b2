"""Golden runs: the per-step losses and final weights of a set of small trainings, bit for bit.

A refactor of the training step (who owns forward, backward, clipping and the optimizer step; how
microbatches are cut; how the loader resumes) must leave every number where it was. This test runs
the cases of tests/workers/golden_runs.py -- every strategy (single, ddp, zero1, zero2, zero3, tensor
parallel, pipeline 1F1B, a hybrid, DeepSpeed ZeRO-2), gradient accumulation, clipping, amp_bf16,
SAM, GradientClipping, the nnScaler gradient reductions through the config path, the Colossal-AI
Engine loop and a crash with a mid-epoch autoresume -- in one 1-process and one 2-process launch,
both forked from the tests' warm server (about 20 s on an idle 2-core machine), and compares them with tests/data/golden_runs.json: each
rank's loss at every step as ``float.hex``, a sha256 of the full final weights (per tensor too, to
name the one that moved) and a sha256 of each rank's optimizer state.

Exact equality holds on one machine with one torch version (one thread per process; gloo on 2
ranks sums in a fixed order). Another torch version, another CPU (a different SIMD path in a
kernel) or another BLAS may legitimately change the last bits, and the failure message says when
the torch version or the CPU differs from the recording's. Then, and only then, re-record:

    .venv/bin/python tests/test_golden_runs.py --record

which runs every case twice, refuses to write if the two runs differ, and rewrites the JSON.
Re-recording is a deliberate act: do it in a commit of its own, say why in the message, and never
to make a refactor pass -- a refactor that changes a number has changed behaviour.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from distributed import WORKERS, check, fork_ranks, fork_run

RECORDING = Path(__file__).parent / "data" / "golden_runs.json"
RUNS = WORKERS / "golden_runs.py"
RECORD_COMMAND = ".venv/bin/python tests/test_golden_runs.py --record"


def run_cases(out: Path) -> dict[str, Any]:
    """Both launches of golden_runs.py; ``{case: entry}`` without the timings."""
    # the one-process cases in one process forked from the warm server (no torchrun variables: no
    # process group), which saves a fresh interpreter's imports (~7 CPU-s: torch, dynamo, kiln)
    (single,) = fork_ranks(RUNS, lambda rank: {}, nproc=1, args=(str(out), "single"), timeout=400)
    check(single)
    check(fork_run(RUNS, str(out), "multi", nproc=2, timeout=400))
    cases: dict[str, Any] = {}
    for group in ("single", "multi"):
        for name, entry in json.loads((out / f"golden_{group}.json").read_text()).items():
            entry.pop("seconds", None)
            cases[name] = entry
    return cases


def _loss(text: str) -> str:
    return f"{text} ({float.fromhex(text)!r})"


def _short(digests: list[str]) -> str:
    return "[" + ", ".join(d[:12] for d in digests) + "]"


def differences(name: str, recorded: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """What differs between two entries of one case, first step first; empty when they agree."""
    problems = []
    for rank, (want, have) in enumerate(zip(recorded["losses"], got["losses"])):
        for step, (a, b) in enumerate(zip(want, have), start=1):
            if a != b:
                before = {1: "the first step", 2: "step 1 agrees"}.get(step, f"steps 1-{step - 1} agree")
                problems.append(
                    f"{name}: rank {rank} loss differs first at step {step} ({before}): "
                    f"recorded {_loss(a)}, got {_loss(b)}"
                )
                break
        else:
            if len(want) != len(have):
                problems.append(f"{name}: rank {rank} ran {len(have)} steps, the recording has {len(want)}")
    if len(recorded["losses"]) != len(got["losses"]):
        problems.append(f"{name}: {len(got['losses'])} ranks, the recording has {len(recorded['losses'])}")
    if recorded["weights_sha256"] != got["weights_sha256"]:
        names = set(recorded["weights"]) | set(got["weights"])
        moved = sorted(k for k in names if recorded["weights"].get(k) != got["weights"].get(k))
        which = f"all {len(names)} tensors" if len(moved) == len(names) else ", ".join(moved) or "none by name"
        ranks = [r for r, (a, b) in enumerate(zip(recorded["weights_sha256"], got["weights_sha256"])) if a != b]
        problems.append(
            f"{name}: final weights differ on rank(s) {ranks or 'all'} ({which}; sha256 recorded "
            f"{_short(recorded['weights_sha256'])}, got {_short(got['weights_sha256'])})"
        )
    if recorded["optimizer_sha256"] != got["optimizer_sha256"]:
        ranks = [r for r, (a, b) in enumerate(zip(recorded["optimizer_sha256"], got["optimizer_sha256"])) if a != b]
        problems.append(f"{name}: optimizer state differs on rank(s) {ranks or 'all'}")
    return problems


def environment() -> dict[str, str]:
    """Where the recording was made: what to compare first when the bits differ."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(), "cpu": cpu}


def _load_recording() -> dict[str, Any]:
    if not RECORDING.exists():
        pytest.fail(f"{RECORDING} is missing: record it with {RECORD_COMMAND}", pytrace=False)
    return json.loads(RECORDING.read_text())


def _recorded_cases() -> list[str]:
    # read at collection time; without a recording one case fails and says how to make it
    return sorted(json.loads(RECORDING.read_text())["cases"]) if RECORDING.exists() else ["(no recording)"]


# -- the test ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    return run_cases(tmp_path_factory.mktemp("golden"))


def _deepspeed_missing() -> bool:
    if importlib.util.find_spec("deepspeed") is not None:
        return False
    if "deepspeed" in os.environ.get("KILN_TEST_REQUIRE", "").split(","):
        raise ImportError("KILN_TEST_REQUIRE names deepspeed but it is not installed: run `make install`")
    return True


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("case", _recorded_cases())
def test_run_matches_the_recording_bit_for_bit(runs, case):
    if case.startswith("deepspeed") and _deepspeed_missing():
        pytest.skip("deepspeed is not installed")
    recording = _load_recording()
    assert case in runs, f"{case}: recorded, but golden_runs.py no longer runs it"
    problems = differences(case, recording["cases"][case], runs[case])
    if problems:
        recorded, here = recording["environment"], environment()
        changed = [
            f"{key} {recorded.get(key)!r} -> {here[key]!r}"
            for key in ("torch", "cpu")
            if recorded.get(key) != here[key]
        ]
        note = ""
        if changed:
            note = (
                f"\nrecorded elsewhere ({'; '.join(changed)}): the last bits may legitimately differ; if this "
                f"code did not change the numbers, re-record deliberately: {RECORD_COMMAND}"
            )
        pytest.fail("\n".join(problems) + note, pytrace=False)


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_every_run_is_recorded(runs):
    new = sorted(set(runs) - set(_load_recording()["cases"]))
    assert not new, f"cases without a recording: {new}; record them with {RECORD_COMMAND}"


# -- recording -----------------------------------------------------------------------------------
def record() -> int:
    """Run every case twice; write the recording only if both runs agree to the bit."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        first, second = run_cases(Path(a)), run_cases(Path(b))
    problems = [p for name in sorted(first) for p in differences(name, first[name], second.get(name, first[name]))]
    problems += [f"{name}: ran only once" for name in sorted(set(first) ^ set(second))]
    if problems:
        print(
            "not recorded: two runs of the same code differ (a nondeterministic case):\n" + "\n".join(problems),
            file=sys.stderr,
        )
        return 1
    RECORDING.parent.mkdir(exist_ok=True)
    data = {
        "about": "tests/test_golden_runs.py; re-record only deliberately: " + RECORD_COMMAND,
        "environment": environment(),
        "cases": first,
    }
    RECORDING.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"recorded {len(first)} cases in {RECORDING}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: python {sys.argv[0]} --record   (to run the test: pytest tests/test_golden_runs.py)")
    sys.exit(record())
