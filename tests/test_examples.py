"""The examples are the main jobs: each runs on 2 real processes and reaches >= 95% on digits.

The walkthroughs run one after another in ONE 2-rank job (tests/workers/examples_worker.py, its
ranks forked by tests/distributed.py's fork_run: each script's ``main`` as its own launch would run
it, from a working directory of its own, its output kept per rank): the process group and DDP's
first construction are paid once, not once per example.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from distributed import ROOT, WORKERS, check

sys.path.insert(0, str(WORKERS))
from examples_worker import one_job  # noqa: E402

EXAMPLES = ROOT / "examples"
# The digits walkthroughs in 6 epochs, not their config's 8 (the cosine schedule spans the 6): their
# amp_fp16 steps are slow on CPU (autocast float16 convolutions, ~4x float32's); 6 reach 96.7-98%, 5 only 95.8%
DIGITS_ARGS = ["--epochs", "6"]
# The Composer-style tour (float32: not slow, but 8 epochs of 22 steps) in 4 epochs, not 8
COMPOSER_ARGS = ["--epochs", "4"]
# The CIFAR-10 walkthrough at a test's size: 64 images, 2 epochs of 2 steps of 8
CIFAR_ARGS = ["--epochs", "2", "--batch-size", "8", "--max-steps", "2"]


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """The one job that runs every walkthrough; a function of an example's name that gives both
    ranks' stdout, as its own `kiln run -n 2 examples/<name>.py` would print it. An example whose
    optional package is missing is left out (its test skips, as before)."""
    out = tmp_path_factory.mktemp("examples")
    scripts = [
        {"name": n, "path": str(EXAMPLES / f"{n}.py"), "argv": DIGITS_ARGS} for n in ("engine_digits", "trainer_digits")
    ]
    if importlib.util.find_spec("torchmetrics") is not None:
        scripts.append({"name": "composer_style", "path": str(EXAMPLES / "composer_style.py"), "argv": COMPOSER_ARGS})
    if importlib.util.find_spec("transformers") is not None:  # last: it is the one that may not import
        _write_cifar(out / "cifar", train=64, test=16)
        argv = ["--data", str(out / "cifar"), *CIFAR_ARGS]
        scripts.append({"name": "cifar10_resnet", "path": str(EXAMPLES / "cifar10_resnet.py"), "argv": argv})
    job, result = one_job(out, scripts, timeout=600)
    yield lambda name: result(name)[1]
    check(job)  # every example returned; the job must also exit 0 (its teardown, as each example's own launch)


def _final_accuracy(stdout: str) -> float:
    line = [line for line in stdout.splitlines() if "final test accuracy" in line][-1]
    return float(line.split("final test accuracy:")[1].split()[0])


def test_engine_walkthrough_two_processes(examples):
    stdout = examples("engine_digits")
    assert "Epoch 0 - train loss" in stdout
    assert stdout.count("final test accuracy") == 1  # rank 0 only
    assert _final_accuracy(stdout) >= 0.95


def test_trainer_walkthrough_on_two_processes_reaches_95_percent(examples):
    # Colossal-AI's Trainer and hooks (tests/test_hooks.py) in the walkthrough, on 2 processes
    stdout = examples("trainer_digits")
    line = [l for l in stdout.splitlines() if "final test accuracy" in l][-1]
    assert float(line.rsplit(":", 1)[1]) >= 0.95, line


def test_composer_style_two_processes(examples):
    pytest.importorskip("torchmetrics")
    stdout = examples("composer_style")
    assert stdout.count("final test accuracy") == 1
    assert _final_accuracy(stdout) >= 0.95


def _write_cifar(folder, train: int, test: int) -> None:
    """A CIFAR-10 python-format folder (the batch files' own layout: a pickled dict of a uint8
    (N, 3072) array and a label list), with images whose class is visible in their colour."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    batches = folder / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    for name, count in (("data_batch_1", train // 2), ("data_batch_2", train - train // 2), ("test_batch", test)):
        labels = rng.integers(0, 10, count)
        data = rng.integers(0, 64, (count, 3072)).astype(np.uint8) + (labels[:, None] * 19).astype(np.uint8)
        with open(batches / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels.tolist()}, f)


def test_cifar10_resnet34_walkthrough_two_processes(examples):
    # torchvision does not import beside this torch build: the example's transformers path runs
    pytest.importorskip("transformers")
    stdout = examples("cifar10_resnet")
    assert "ResNet-34 (transformers) on 64 CIFAR-10 images, 2 process(es)" in stdout
    assert stdout.count("Epoch 1 - train loss") == 1  # two epochs, logged on rank 0


def test_cifar10_reader_refuses_a_pickle_that_is_not_cifar_data(tmp_path):
    import pickle
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    from cifar10_resnet import read_batches

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    (folder / "data_batch_1").write_bytes(pickle.dumps({b"data": __import__("os").getcwd}))
    with pytest.raises(pickle.UnpicklingError, match="holds posix.getcwd, which is not CIFAR data"):
        read_batches(folder, ["data_batch_1"])
