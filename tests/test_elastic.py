"""A rank that dies mid-run under `kiln run --max-restarts` is restarted and the job autoresumes
from `last`, ending with the same weights as an uninterrupted run."""

from __future__ import annotations

import json

from distributed import WORKERS, check, kiln_run


def test_elastic_restart_resumes_from_last_with_identical_weights(tmp_path):
    plain, crashed = tmp_path / "plain", tmp_path / "crashed"
    plain.mkdir()
    crashed.mkdir()
    check(kiln_run(WORKERS / "elastic_trainer.py", str(plain), "none", timeout=240))
    check(kiln_run(WORKERS / "elastic_trainer.py", str(crashed), "crash", extra=["--max-restarts", "1"], timeout=240))
    ref = json.loads((plain / "rank0.json").read_text())
    for rank in range(2):
        got = json.loads((crashed / f"rank{rank}.json").read_text())
        assert got["attempt"] == 1 and got["start"] == 4  # restarted once, from the checkpoint at batch 4
        assert got["weights"] == ref["weights"]
