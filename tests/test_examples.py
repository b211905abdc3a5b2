"""The examples are the main jobs: each runs on 2 real processes and reaches >= 95% on digits."""

from __future__ import annotations

import pytest

from distributed import ROOT, check, kiln_run


def _final_accuracy(stdout: str) -> float:
    line = [line for line in stdout.splitlines() if "final test accuracy" in line][-1]
    return float(line.split("final test accuracy:")[1].split()[0])


def test_engine_walkthrough_two_processes():
    result = check(kiln_run(ROOT / "examples" / "engine_digits.py", timeout=300))
    assert "Epoch 0 - train loss" in result.stdout
    assert result.stdout.count("final test accuracy") == 1  # rank 0 only
    assert _final_accuracy(result.stdout) >= 0.95


def test_composer_style_two_processes():
    pytest.importorskip("torchmetrics")
    result = check(kiln_run(ROOT / "examples" / "composer_style.py", timeout=300))
    assert result.stdout.count("final test accuracy") == 1
    assert _final_accuracy(result.stdout) >= 0.95
