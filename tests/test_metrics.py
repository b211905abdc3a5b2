"""Tests for kiln.metrics: the inferred Accuracy, torchmetrics forwarding, CrossEntropy and cross-rank sync."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torchmetrics

from distributed import WORKERS, check, fork_run
from kiln import metrics


def _data(n=40, c=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g), torch.randint(0, c, (n,), generator=g)


# --- Accuracy ----------------------------------------------------------------------------------


def test_accuracy_without_arguments_is_multiclass_top1_from_logits():
    logits, labels = _data()
    acc = metrics.Accuracy()
    assert isinstance(acc, metrics.Accuracy) and isinstance(acc, torchmetrics.Metric)
    for x, y in zip(logits.split(7), labels.split(7)):
        acc.update(x, y)
    expected = (logits.argmax(1) == labels).float().mean()
    assert torch.allclose(acc.compute(), expected)
    reference = torchmetrics.classification.MulticlassAccuracy(num_classes=5, average="micro")
    assert torch.allclose(acc.compute(), reference(logits, labels))


def test_accuracy_forward_returns_the_batch_value_and_accumulates():
    acc = metrics.Accuracy()
    assert acc(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0])) == 0.5
    assert acc(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 1])) == 1.0
    assert acc.compute() == 0.75


def test_accuracy_class_dimension_last_or_second():
    g = torch.Generator().manual_seed(1)
    scores, target = torch.randn(3, 4, 6, generator=g), torch.randint(0, 6, (3, 4), generator=g)  # (N, L, C)
    expected = (scores.argmax(-1) == target).float().mean()
    assert torch.allclose(metrics.Accuracy()(scores, target), expected)  # Colossal-AI: classes last
    assert torch.allclose(metrics.Accuracy()(scores.permute(0, 2, 1), target), expected)  # torch: classes in dim 1
    with pytest.raises(ValueError, match=r"\(3, 4, 6\).*\(4, 3\)"):
        metrics.Accuracy()(scores, target.T)


def test_accuracy_binary_labels_top_k_and_ignore_index():
    assert metrics.Accuracy()(torch.tensor([0.9, 0.2, 0.6]), torch.tensor([1, 0, 0])) == pytest.approx(2 / 3)
    assert metrics.Accuracy()(torch.tensor([3.0, -2.0, 0.5]), torch.tensor([1, 0, 0])) == pytest.approx(2 / 3)  # logits
    assert metrics.Accuracy()(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 0])) == pytest.approx(2 / 3)  # labels
    logits, labels = _data()
    top3 = torchmetrics.classification.MulticlassAccuracy(num_classes=5, top_k=3, average="micro")
    assert torch.allclose(metrics.Accuracy(top_k=3)(logits, labels), top3(logits, labels))
    labels[:10] = -100
    keep = labels != -100
    expected = (logits[keep].argmax(1) == labels[keep]).float().mean()
    assert torch.allclose(metrics.Accuracy(ignore_index=-100)(logits, labels), expected)
    with pytest.raises(ValueError, match="top_k"):
        metrics.Accuracy(top_k=0)


def test_accuracy_empty_is_zero_and_copies_keep_state():
    with pytest.warns(UserWarning, match="before the ``update``"):  # torchmetrics' own warning
        assert metrics.Accuracy().compute() == 0
    acc = metrics.Accuracy(top_k=2)
    acc.update(*_data())
    for clone in (copy.deepcopy(acc), pickle.loads(pickle.dumps(acc)), acc.clone()):
        assert type(clone) is metrics.Accuracy and clone.top_k == 2
        assert clone.compute() == acc.compute()


def test_accuracy_with_a_task_forwards_to_torchmetrics():
    assert type(metrics.Accuracy(task="multiclass", num_classes=5)).__name__ == "MulticlassAccuracy"
    assert type(metrics.Accuracy(num_classes=5)).__name__ == "MulticlassAccuracy"  # task implied
    assert type(metrics.Accuracy(num_labels=3)).__name__ == "MultilabelAccuracy"
    assert type(metrics.Accuracy(task="binary")).__name__ == "BinaryAccuracy"


@pytest.mark.parametrize("name", ["Precision", "Recall", "F1Score"])
def test_precision_recall_f1_infer_the_task(name):
    logits, labels = _data()
    ours = getattr(metrics, name)(num_classes=5)
    theirs = getattr(torchmetrics, name)(task="multiclass", num_classes=5)
    assert torch.allclose(ours(logits, labels), theirs(logits, labels))
    assert type(getattr(metrics, name)(task="binary")).__name__.startswith("Binary")
    with pytest.raises(ValueError, match="num_classes"):
        getattr(metrics, name)()


# --- CrossEntropy, MeanMetric, sync_metrics --------------------------------------------------------


def test_cross_entropy_is_the_mean_over_all_samples():
    logits, labels = _data(n=50)
    ce = metrics.CrossEntropy()
    for x, y in zip(logits.split(16), labels.split(16)):  # uneven last batch: a mean of means would differ
        ce.update(x, y)
    assert torch.allclose(ce.compute(), F.cross_entropy(logits, labels), atol=1e-6)
    labels[:5] = -100
    ce = metrics.CrossEntropy(ignore_index=-100)
    ce.update(logits, labels)
    assert torch.allclose(ce.compute(), F.cross_entropy(logits, labels, ignore_index=-100), atol=1e-6)
    soft = torch.softmax(torch.randn(50, 5), dim=1)
    ce = metrics.CrossEntropy()
    ce.update(logits, soft)
    assert torch.allclose(ce.compute(), F.cross_entropy(logits, soft), atol=1e-6)


def test_mean_metric_weights_and_sync_metrics_names():
    mean = metrics.MeanMetric()
    mean.update(torch.tensor(1.0), weight=3)
    mean.update(torch.tensor(5.0), weight=1)
    acc = metrics.Accuracy()
    acc.update(torch.tensor([[1.0, 0.0]]), torch.tensor([0]))
    values = metrics.sync_metrics({"loss": mean, "Accuracy": acc}, prefix="eval/")
    assert values == {"eval/loss": 2.0, "eval/Accuracy": 1.0}
    assert all(type(v) is float for v in values.values())
    assert metrics.sync_metrics([acc]) == {"Accuracy": 1.0}
    collection = metrics.MetricCollection({"Accuracy": metrics.Accuracy(), "CE": metrics.CrossEntropy()})
    collection.update(*_data())
    assert set(metrics.sync_metrics({"all": collection}, prefix="eval/")) == {"eval/Accuracy", "eval/CE"}
    per_class = torchmetrics.classification.MulticlassAccuracy(num_classes=5, average=None)
    per_class.update(*_data())
    assert metrics.sync_metrics({"per_class": per_class})["per_class"].shape == (5,)  # non-scalars stay tensors


def test_import_kiln_does_not_import_torchmetrics():
    code = "import sys, kiln, kiln.callbacks; assert 'torchmetrics' not in sys.modules; import kiln.metrics"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- two ranks ---------------------------------------------------------------------------------


@pytest.mark.world_size(2)
def test_metrics_under_two_ranks_equal_single_process(tmp_path):
    check(fork_run(WORKERS / "metrics_sync.py", str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(64, 5, generator=g), torch.randint(0, 5, (64,), generator=g)
    losses = torch.rand(64, generator=g)
    expected = {
        "eval/Accuracy": (logits.argmax(1) == labels).float().mean().item(),
        "eval/Top2": metrics.Accuracy(top_k=2)(logits, labels).item(),
        "eval/CrossEntropy": F.cross_entropy(logits, labels).item(),
        "eval/F1": torchmetrics.F1Score(task="multiclass", num_classes=5, average="macro")(logits, labels).item(),
        "eval/loss": losses.mean().item(),
        "eval/tm_accuracy": (logits.argmax(1) == labels).float().mean().item(),
    }
    for values in ranks:
        for key, value in expected.items():
            assert values[key] == pytest.approx(value, abs=1e-6), key
    # The ranks saw different data, so this really was a sync and not a coincidence.
    assert ranks[0]["local_accuracy"] != ranks[1]["local_accuracy"]
