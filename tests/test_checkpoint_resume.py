"""Real processes killed and resumed: a hard exit (os._exit) mid-epoch or at an epoch boundary, and
SIGTERM, each resumed from `last`, end bit-for-bit where an uninterrupted run does; on 1 and 2 ranks
(the Trainer end to end is in test_checkpoint_trainer.py).

The loop is tests/workers/ckpt_loop.py: dropout, shuffling, AdamW, warmup+cosine, microbatches,
amp_bf16 and an algorithm drawing from python's, numpy's and torch's RNGs.
"""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

from distributed import WORKERS, check, fork_ranks, fork_run, free_port
from kiln.checkpoint import PREEMPTED_EXIT_CODE, verify_checkpoint

LOOP = WORKERS / "ckpt_loop.py"
sys.path.insert(0, str(WORKERS))  # the loop's own imports (then_runs), when it runs in this process


def _in_process(out, *args):
    """Run the loop here (no interpreter start-up to pay for); kiln's context is reset by conftest."""
    saved = sys.argv
    sys.argv = [str(LOOP), str(out), *args]
    try:
        runpy.run_path(str(LOOP), run_name="__main__")
    finally:
        sys.argv = saved


def _subprocess(out, *args):
    """``python ckpt_loop.py OUT ARGS`` in a process of its own (it dies), forked from the warm server."""
    return fork_ranks(LOOP, lambda rank: {}, nproc=1, args=(str(out), *args), timeout=300)[0]


def _assert_same_final(a, b, ranks=(0,)):
    for rank in ranks:
        x, y = (torch.load(f"{d}/final_rank{rank}.pt", weights_only=True) for d in (a, b))
        for section in ("model", "optimizer"):
            for key, value in x[section].items():
                same = (
                    torch.equal(value, y[section][key]) if isinstance(value, torch.Tensor) else value == y[section][key]
                )
                assert same, f"rank {rank}: {section}.{key} differs after the resume"
        assert (x["calls"], x["lr"], x["batch"]) == (y["calls"], y["lr"], y["batch"])
        assert torch.equal(x["rng"], y["rng"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    _in_process(out)
    return out


@pytest.mark.parametrize(
    "interval, die_after, resumes_from",
    [("2ba", 5, "ep0-ba4"), ("1ep", 13, "ep1-ba12")],
    ids=["mid-epoch", "epoch-boundary"],
)
def test_hard_exit_then_resume_is_bit_exact(tmp_path, uninterrupted, interval, die_after, resumes_from):
    crashed = _subprocess(tmp_path, "--interval", interval, "--die-after", str(die_after))
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    assert (tmp_path / "ckpt" / "last").resolve().name == resumes_from
    _in_process(tmp_path, "--interval", interval, "--resume")
    _assert_same_final(uninterrupted, tmp_path)


def test_sigterm_checkpoints_exits_75_and_resumes_exactly(tmp_path, uninterrupted):
    preempted = _subprocess(tmp_path, "--interval", "5ba", "--sigterm-after", "7")
    assert preempted.returncode == PREEMPTED_EXIT_CODE, preempted.stderr[-3000:]
    assert "Traceback" not in preempted.stderr
    # the signal came after batch 7; the checkpoint is taken at the end of the batch that follows
    assert (tmp_path / "ckpt" / "last").resolve().name == "ep0-ba8"
    verify_checkpoint(tmp_path / "ckpt" / "last")
    _in_process(tmp_path, "--interval", "5ba", "--resume")
    _assert_same_final(uninterrupted, tmp_path)


def test_ddp_hard_exit_and_sigterm_on_one_rank_resume_exactly(tmp_path):
    # Four launches' runs in three (ckpt_loop.py --then): the uninterrupted run finishes in the
    # processes of the one killed after it, and both resumes share one launch.
    full, killed, term = (str(tmp_path / name) for name in ("full", "killed", "term"))
    ddp = ("--strategy", "ddp")
    died = fork_run(LOOP, full, *ddp, "--then", killed, *ddp, "--die-after", "3")
    assert died.returncode != 0 and (tmp_path / "killed/ckpt/last").resolve().name == "ep0-ba2"
    missing = [r for r in (0, 1) if not (tmp_path / f"full/final_rank{r}.pt").exists()]
    assert not missing, f"the uninterrupted run did not finish on ranks {missing}:\n{died.stderr[-3000:]}"

    # SIGTERM reaches rank 1 only: both ranks agree, checkpoint the same batch and exit 75.
    port = free_port()
    env = lambda r: {"RANK": r, "WORLD_SIZE": 2, "LOCAL_RANK": r, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    results = fork_ranks(LOOP, env, args=(term, *ddp, "--sigterm-after", "4", "--sigterm-rank", "1"), timeout=300)
    assert [r.returncode for r in results] == [PREEMPTED_EXIT_CODE] * 2, results[1].stderr[-3000:]
    assert (tmp_path / "term/ckpt/last").resolve().name == "ep0-ba5"

    check(fork_run(LOOP, killed, *ddp, "--resume", "--then", term, *ddp, "--resume"))
    _assert_same_final(tmp_path / "full", tmp_path / "killed", ranks=(0, 1))
    _assert_same_final(tmp_path / "full", tmp_path / "term", ranks=(0, 1))
