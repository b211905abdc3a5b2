# Two commands do everything on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed
DS_STAMP := $(VENV)/.deepspeed-installed

LINT_PATHS := src tests benchmarks examples

.PHONY: demo test lint ruff install bench clean docs gpu-check

# torch is pinned and installed first: with nothing installed, a looser spec pulls a multi-GB
# CUDA build; 2.13.0 is the local CPU build here and the default build elsewhere. The distribution
# was called "kiln" before 0.2.0 (now kiln-train): an old install of it claims the same files.
# pip byte-compiles what it installs (torch: 48 CPU-s on one core; 15 with --no-compile), and that
# is kept: where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing compiled on
# import is saved, so without pip's .pyc files every process would compile torch again (+10 CPU-s).
PIP_INSTALL := $(PY) -m pip install --quiet
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) torch==2.13.0
	$(PY) -m pip uninstall --quiet --yes kiln 2>/dev/null || true
	$(PIP_INSTALL) -e '.[dev]'
	touch $(STAMP)

# DeepSpeed (strategy='deepspeed', tested in tests/test_deepspeed.py) ships as an sdist whose
# build imports torch. Built without isolation it uses the torch pinned above; an isolated build
# would download a CUDA torch. Its build-time imports come first. Only the tests need it.
$(DS_STAMP): $(STAMP)
	$(PIP_INSTALL) setuptools wheel hjson ninja py-cpuinfo psutil msgpack einops pydantic nvidia-ml-py
	$(PIP_INSTALL) --no-build-isolation deepspeed==0.19.8
	touch $(DS_STAMP)

install: $(STAMP) $(DS_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kiln run -n 2 examples/engine_digits.py

# ruff (lint, then formatting) and mypy (src/kiln); settings in pyproject.toml. The dev extra
# installs both.
lint: ruff $(STAMP)
	$(PY) -m mypy

ruff: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

# ruff first: it fails in seconds, before the DeepSpeed build and the suite. mypy runs beside the
# suite: from a clean clone (no .mypy_cache) it takes ~145 CPU-s on one core, which alone would leave
# the other core idle for over two minutes; its output is printed, and its failure fails `make test`,
# after the suite. PYTHONDONTWRITEBYTECODE (set on this project's machines) is cleared for the suite:
# its ~300 processes would each compile kiln, the tests and their workers from source again (about a
# CPU-second per `kiln run -n 2`); the .pyc files go to __pycache__ folders git ignores.
# KILN_TEST_REQUIRE: optional packages (by import name) and tools whose tests must run here rather
# than skip (tests/conftest.py): deepspeed and every optional package the dev extra installs; a
# value from the environment is added (.ci/run adds chromium).
# pytest-xdist: TEST_WORKERS processes (0: the suite in one process), each running a whole file at
# a time (--dist loadfile: a module-scoped launch is made once), files handed out in the order
# tests/conftest.py gives them (the longest first) rather than xdist's (most tests first). Three
# workers on this 2-core machine: much of the suite waits (signals, heartbeats, rendezvous) rather
# than computes; the whole suite took 16 min 19 s on 2 workers, 10 min 38 s on 3, 10 min 48 s on 4.
comma := ,
TEST_OPTIONAL := deepspeed,transformers,torchao,torchdata,datasets,matplotlib,tensorboard,wandb,mlflow,sklearn
TEST_OPTIONAL := $(TEST_OPTIONAL),fsspec,s3fs,moto,build,mkdocs,mkdocstrings,torchft,ruff,tomli
TEST_REQUIRE := $(TEST_OPTIONAL)$(if $(KILN_TEST_REQUIRE),$(comma)$(KILN_TEST_REQUIRE))
TEST_WORKERS ?= 3
test: ruff $(DS_STAMP)
	@$(PY) -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	PYTHONDONTWRITEBYTECODE= KILN_TEST_REQUIRE=$(TEST_REQUIRE) \
		$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; \
	suite=$$?; wait $$mypy; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	test $$suite = 0 && test $$typed = 0

# The documentation site (mkdocs.yml) into $(SITE_DIR), built strictly: a broken link, nav entry
# or API reference fails it. tests/test_docs.py runs the same build into a temporary folder, so
# `make test` covers it without writing site/.
SITE_DIR ?= site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir $(SITE_DIR)

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# Every CUDA path, in at most 8 minutes on one H100/H200: runs/gpu_check/gpu_check.md (and .json,
# logs/), the table printed at the end. On a machine without CUDA it runs what a CPU can, names
# the rest in one line and exits 0. It runs in the environment `make install` builds (torch, the
# dev extra: pytest, transformers, torchao), built first only when there is none: a GPU machine
# may have no package index, so an existing one is used as it is, even if pyproject.toml is newer.
# GPU_CHECK_PY=python3: a machine with no package index whose python3 already has a CUDA torch
# (the GPU machines lent to this project's sessions) runs with that interpreter and kiln from src/,
# building nothing; the fp8 part then needs torchao on PYTHONPATH (docs/gpu.md).
GPU_CHECK_OUT ?= runs/gpu_check
GPU_CHECK_PY ?=
gpu-check: $(if $(GPU_CHECK_PY)$(wildcard $(STAMP)),,$(STAMP))
	$(if $(GPU_CHECK_PY),PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_CHECK_PY),$(PY)) \
		benchmarks/gpu_check.py --out $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
