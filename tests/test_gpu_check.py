"""``make gpu-check`` (benchmarks/gpu_check.py) on a machine without CUDA: the parts that can run
run, the rest are named in one line, the JSON and the Markdown table hold every part, a part past
its time budget is stopped with what it measured so far, and the exit status is 0."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = ["gpu_tests", "nccl", "precision", "fsdp2_bf16", "compile_ckpt", "fp8", "async_ckpt", "lm"]
CUDA_ONLY = ["gpu_tests", "nccl"]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_check"]


def _rows(table: str) -> list[list[str]]:
    lines = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| #")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if "---" not in line]


@pytest.mark.timeout(180)
def test_cpu_mode_runs_a_part_writes_json_and_table_and_names_what_needs_cuda(tmp_path):
    out = tmp_path / "check"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--parts", "async_ckpt", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [part["name"] for part in report["parts"]] == PARTS
    assert report["cuda"] is CUDA and report["quick"] is True
    assert 0 < report["elapsed_s"] <= time.monotonic() - started
    parts = {part["name"]: part for part in report["parts"]}
    # the part that ran: a synchronous save against two background saves, the second one reusing buffers
    ran = parts["async_ckpt"]
    assert ran["status"] == "pass" and ran["seconds"] > 0, ran
    assert "buffers reused: True" in ran["summary"] and ran["details"]["stall_s"][1] < ran["details"]["sync_s"]
    assert (out / "logs" / "async_ckpt.log").exists()
    for name in PARTS:
        if name != "async_ckpt":
            expected = (
                ("skipped", "needs CUDA") if name in CUDA_ONLY and not CUDA else ("not run", "not selected (--parts)")
            )
            assert (parts[name]["status"], parts[name]["summary"]) == expected, name
    # the table: in the file and printed, one row per part, as in the JSON
    table = (out / "gpu_check.md").read_text()
    assert table in done.stdout
    rows = _rows(table)
    assert [row[0] for row in rows] == [str(i) for i in range(1, 9)]
    assert [(row[1], row[2], row[4]) for row in rows] == [
        (p["title"], p["status"], p["summary"]) for p in report["parts"]
    ]
    skip_lines = [line for line in done.stdout.splitlines() if line.startswith("no CUDA here:")]
    if CUDA:
        assert not skip_lines
    else:
        assert skip_lines == ["no CUDA here: gpu_tests, nccl need it and were skipped"]


@pytest.mark.timeout(60)  # a part left running (the sleeps below) would hold it for 2 minutes
def test_a_part_past_its_budget_is_stopped_and_keeps_what_it_measured(gpu_check, tmp_path):
    row = {"size": "tiny", "levers": "none", "kiln_tokens_per_sec": 1000.0, "raw_tokens_per_sec": 1010.0,
           "tokens_per_sec_ratio": 0.99, "kiln_mfu": 0.41, "raw_mfu": 0.42, "kiln_peak_bytes": 2**30,
           "raw_peak_bytes": 2**30}  # fmt: skip
    writes_then_hangs = (
        "import json, sys, time\n"
        f"open(sys.argv[1], 'w').write(json.dumps({{'peak_flops_per_sec': 1e15, 'rows': [{row!r}]}}))\n"
        "time.sleep(120)\n"
    )
    part = gpu_check.Part(
        "lm", "lm", False, (1, 1), lambda args, files: [sys.executable, "-c", writes_then_hangs, str(files / "lm.json")],
        gpu_check._read_lm,
    )  # fmt: skip
    started = time.monotonic()
    status, summary, details = gpu_check._run(part, None, tmp_path / "files", tmp_path / "lm.log", timeout=3)
    assert time.monotonic() - started < 30  # killed, not waited for
    assert status == "timeout"
    assert summary == (
        "stopped after 3 s; so far: tiny none: kiln 1000 vs raw 1010 tok/s (median step ratio kiln/raw x0.990), "
        "MFU 41.0% vs 42.0%, "
        "peak memory 1.00 vs 1.00 GiB"
    )
    assert details["rows"] == [row]
    hangs = gpu_check.Part("x", "x", False, (1, 1), lambda a, f: [sys.executable, "-c", "import time; time.sleep(120)"],
                           gpu_check._read_result)  # fmt: skip
    assert gpu_check._run(hangs, None, tmp_path / "x", tmp_path / "x.log", timeout=2)[:2] == (
        "timeout",
        "stopped after 2 s",
    )


def test_a_spent_budget_skips_the_rest_and_a_failing_part_fails_the_run(gpu_check, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--budget", "5", "--out", str(tmp_path)])
    assert gpu_check.main() == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    ran = [p for p in report["parts"] if p["name"] not in CUDA_ONLY or CUDA]
    assert {p["status"] for p in ran} == {"skipped"}
    assert {p["summary"] for p in ran} == {"no time left of the 5 s budget"}
    # a part whose process fails: its last output line in the table, and exit status 1
    failing = gpu_check.Part("precision", "p", False, (60, 60),
                             lambda a, f: [sys.executable, "-c", "raise SystemExit('CUDA error: out of memory')"],
                             gpu_check._read_result)  # fmt: skip
    monkeypatch.setattr(gpu_check, "PARTS", [failing])
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path)])
    assert gpu_check.main() == 1
    (part,) = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert part["status"] == "fail"
    assert part["summary"] == "the part wrote no result (see its log) (exit 1: CUDA error: out of memory)"


def test_pytest_parts_read_junit(gpu_check, tmp_path):
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_cuda_paths" name="test_a"/>'
        '<testcase classname="tests.test_cuda_paths" name="test_b"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    status, summary, details = gpu_check._read_junit(tmp_path)
    assert (status, summary) == ("fail", "3 passed, 1 failed, 1 skipped: test_cuda_paths::test_b")
    assert details["failed_tests"] == ["test_cuda_paths::test_b"]
    files = [Path(f).name for f in gpu_check._gpu_test_files()]
    assert {"test_cuda_paths.py", "test_callbacks.py", "test_checkpoint_staging.py"} <= set(files)
    assert "test_gpu_check.py" not in files
