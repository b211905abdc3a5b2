"""`make test` requires ruff and tomli where their tests could skip (issue 34): KILN_TEST_REQUIRE names
them, and a skip for a package it names fails (tests/conftest.py, tests/test_docs.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, _required_import_skipped

MAKE_OPTIONAL = (
    "deepspeed,transformers,torchao,torchdata,datasets,matplotlib,tensorboard,wandb,mlflow,sklearn,"
    "fsspec,s3fs,moto,build,mkdocs,mkdocstrings,torchft,ruff,tomli"
)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_test_requires_ruff_and_tomli(monkeypatch):
    monkeypatch.delenv("KILN_TEST_REQUIRE", raising=False)
    result = subprocess.run(
        ["make", "--no-print-directory", "-s", "--eval", "print-require: ; @echo $(TEST_REQUIRE)", "print-require"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == MAKE_OPTIONAL


def _skip_report(reason: str) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid="tests/test_packaging.py::t", location=("tests/test_packaging.py", 1, "t"), keywords={},
        outcome="skipped", longrepr=("tests/test_packaging.py", 25, f"Skipped: {reason}"), when="setup",
    )  # fmt: skip


def test_a_tomli_skip_fails_when_required_and_skips_otherwise(monkeypatch):
    # tests/test_packaging.py on Python 3.10 (no tomllib): pytest.importorskip("tomli")
    reason = "could not import 'tomli': No module named 'tomli'"
    monkeypatch.setenv("KILN_TEST_REQUIRE", "mkdocs,ruff")
    report = _skip_report(reason)
    _required_import_skipped(report)
    assert report.outcome == "skipped"
    monkeypatch.setenv("KILN_TEST_REQUIRE", MAKE_OPTIONAL)
    _required_import_skipped(report)
    assert report.outcome == "failed"
    assert report.longrepr == f"KILN_TEST_REQUIRE names tomli, so this must run: {reason}"


@pytest.mark.skipif(sys.version_info >= (3, 11), reason="tomllib is in the standard library from 3.11")
def test_tomli_is_installed_where_tomllib_is_missing():
    # pytest and mypy (the dev extra) depend on tomli before 3.11, so `make test` may require it
    import tomli

    assert tomli.loads('a = "b"') == {"a": "b"}
