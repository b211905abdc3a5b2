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


def test_cifar10_resnet34_walkthrough_two_processes(tmp_path):
    # torchvision does not import beside this torch build: the example's transformers path runs
    pytest.importorskip("transformers")
    _write_cifar(tmp_path, train=64, test=16)
    result = check(
        kiln_run(
            ROOT / "examples" / "cifar10_resnet.py",
            "--data",
            str(tmp_path),
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--max-steps",
            "2",
            timeout=300,
        )
    )
    assert "ResNet-34 (transformers) on 64 CIFAR-10 images, 2 process(es)" in result.stdout
    assert result.stdout.count("Epoch 1 - train loss") == 1  # two epochs, logged on rank 0


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
