"""A rank that dies mid-run is restarted and the job autoresumes from `last`, ending with the same
weights as an uninterrupted run (the same world size: the RNG states come back too).

Both attempts are forked from the warm server (tests/distributed.py), as `kiln run --max-restarts 1`
runs them: the first one's peers stopped once a rank failed (SIGTERM, as torchrun's agent stops them),
the second with the agent's restart count. The agent's restart itself, with real launchers, is
tested by tests/test_multinode.py (an elastic job's restart after a node's death resumes from its
last checkpoint, bit for bit against a plain-torch replay), tests/test_fault_tolerance_kill.py and
tests/test_one_traceback.py (`kiln run -n 2 --max-restarts 1` after a rank's death).
"""

from __future__ import annotations

import json

from distributed import WORKERS, check, fork_run


def test_elastic_restart_resumes_from_last_with_identical_weights(tmp_path):
    plain, crashed = tmp_path / "plain", tmp_path / "crashed"
    plain.mkdir()
    crashed.mkdir()
    # the first attempt trains the uninterrupted reference in `plain`, then the run that crashes
    # (rank 1 exits at batch 5); the restarted attempt resumes that run only
    worker, args = WORKERS / "elastic_trainer.py", (str(crashed), "crash", str(plain))
    first = fork_run(worker, *args, timeout=240)
    assert first.returncode == 1, first.stderr[-3000:]
    check(fork_run(worker, *args, env={"TORCHELASTIC_RESTART_COUNT": "1"}, timeout=240))
    ref = json.loads((plain / "rank0.json").read_text())
    assert ref["attempt"] == 0 and ref["start"] == 0  # the reference ran whole, before the crash
    for rank in range(2):
        got = json.loads((crashed / f"rank{rank}.json").read_text())
        assert got["attempt"] == 1 and got["start"] == 4  # restarted once, from the checkpoint at batch 4
        assert got["weights"] == ref["weights"]
