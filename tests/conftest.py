"""Shared fixtures: every test starts with no process group, no kiln context and its own env.

KILN_TEST_REQUIRE (comma-separated; `make test` sets it) names the optional packages, by import
name, whose tests must run here: a test or test file that ``pytest.importorskip`` would skip
because one of them is missing, or fails to import a module it needs, fails instead. Without the
variable (a plain ``pytest`` without the extras) those tests skip.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

# torch.compile's inductor compiles in the process itself: by default each compiling process starts a
# pool of fresh interpreters that import torch again (seconds of CPU each on this 2-core machine).
# Read when torch._inductor's config is imported, so set before torch; subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

# One intra-op thread in each pytest process (OMP_NUM_THREADS in the environment, which subprocesses inherit, is left
# as it is; tests/distributed.py gives every rank OMP_NUM_THREADS=1). The suite's models are tiny and
# `make test` runs one pytest worker per core: with torch's default of one thread per core, OpenMP's
# threads spin-wait for each other on the oversubscribed cores, and the in-process tests cost 2.5x
# the CPU (tests/test_algorithms_resume.py: 52 CPU-s, 21 with one thread).
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

# pytest.importorskip's skip reasons (a missing module, or one older than minversion)
_IMPORT_SKIP = re.compile(r"^(?:could not import|module) '([\w.]+)'")


def _required_import_skipped(report: pytest.CollectReport | pytest.TestReport) -> None:
    """Turn an importorskip skip of a module KILN_TEST_REQUIRE names into a failure."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = report.longrepr[2].removeprefix("Skipped: ")
    found = _IMPORT_SKIP.match(reason)
    required = os.environ.get("KILN_TEST_REQUIRE", "").split(",")
    if found and found.group(1).partition(".")[0] in required:
        report.outcome = "failed"
        report.longrepr = f"KILN_TEST_REQUIRE names {found.group(1).partition('.')[0]}, so this must run: {reason}"


# The files that take longest (11 s to 3 min each under `make test` on this 2-core machine, read
# from a whole run on 3 workers), longest first; the rest follow in their usual order. `make test` hands whole
# files to its pytest-xdist workers in this order (--dist loadfile --no-loadscope-reorder), each
# taking the next file as it finishes one, so no worker is left running a long file alone at the end.
LONGEST_FIRST = (
    "test_examples.py",
    "test_multinode.py",  # drills of real launchers (issue 24)
    "test_sequence_parallel.py",
    "test_packaging.py",
    "test_levers.py",
    "test_dry_run.py",
    "test_dry_run_steady.py",
    "test_checkpoint_storage.py",
    "test_one_traceback.py",  # real kiln run launches of up to 3 ranks
    "test_hygiene.py",
    "test_hf_models.py",
    "test_plan_vs_real.py",
    "test_clean_exit.py",
    "test_run_stop.py",
    "test_fault_tolerance_kill.py",
    "test_deepspeed.py",
    "test_fault_tolerance.py",
    "test_search_vs_dry_run.py",
    "test_quiet_imports.py",
    "test_docs.py",
    "test_stateful_loader.py",
    "test_timeouts.py",
    "test_migrate.py",
    "test_hf_datasets.py",
    "test_report.py",
    "test_expert_parallel.py",
    "test_checkpoint_fuzz.py",
    "test_crash_durability.py",
    "test_parallel.py",
    "test_hf_load.py",
    "test_parallel_sgd.py",
    "test_plan_search.py",
    "test_launch_join.py",
    "test_launch.py",
    "test_pipeline_zero_bubble.py",
    "test_checkpoint_crash.py",
    "test_golden_runs.py",
    "test_gpu_check.py",
    "test_resume_full.py",
    "test_runlock.py",
    "test_run_failures.py",
    "test_activation_estimate.py",
    "test_lm_example.py",
    "test_metrics.py",
    "test_loggers.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file stays together


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _required_import_skipped(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _required_import_skipped(report)
    return report


@pytest.fixture(autouse=True)
def _clean_kiln_state(monkeypatch):
    """Destroy process groups and forget the kiln context around each test; restore env vars."""
    saved = dict(os.environ)
    yield
    import torch.distributed as dist

    from kiln.launch.context import destroy

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    destroy()
    os.environ.clear()
    os.environ.update(saved)
    # fsspec keeps one filesystem per set of arguments; an S3 endpoint read from AWS_ENDPOINT_URL
    # is not among them, so a later test's local S3 server (another port) would get this test's.
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        s3fs.S3FileSystem.clear_instance_cache()
