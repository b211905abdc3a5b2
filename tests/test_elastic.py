"""A rank that dies mid-run under `kiln run --max-restarts` is restarted and the job autoresumes
from `last`, ending with the same weights as an uninterrupted run."""

from __future__ import annotations

import json

from distributed import WORKERS, check, kiln_run


def test_elastic_restart_resumes_from_last_with_identical_weights(tmp_path):
    plain, crashed = tmp_path / "plain", tmp_path / "crashed"
    plain.mkdir()
    crashed.mkdir()
    # one launch: its first attempt trains the uninterrupted reference in `plain`, then the run that
    # crashes; the restarted attempt resumes that run only
    worker = WORKERS / "elastic_trainer.py"
    check(kiln_run(worker, str(crashed), "crash", str(plain), extra=["--max-restarts", "1"], timeout=240))
    ref = json.loads((plain / "rank0.json").read_text())
    assert ref["attempt"] == 0 and ref["start"] == 0  # the reference ran whole, before the crash
    for rank in range(2):
        got = json.loads((crashed / f"rank{rank}.json").read_text())
        assert got["attempt"] == 1 and got["start"] == 4  # restarted once, from the checkpoint at batch 4
        assert got["weights"] == ref["weights"]
