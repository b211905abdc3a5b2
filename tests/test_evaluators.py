"""Named evaluation sets (kiln.Evaluator): each with its own metrics and interval, logged as
eval/<label>/<metric>; a plain eval loader keeps eval/<metric>. The two-rank case runs two sets at
different intervals under zero3 (every forward a collective) on uneven shards."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import kiln
from distributed import WORKERS, fork_ranks, free_port
from kiln.callbacks import EarlyStopper
from kiln.loggers import LoggerDestination
from kiln.metrics import Accuracy


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


class Net(kiln.Model):
    """A kiln.Model with two metrics of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, batch):
        return self.net(batch[0])

    def loss(self, outputs, batch):
        return F.cross_entropy(outputs, batch[1])

    def get_metrics(self, is_train=False):
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        return {
            "Accuracy": MulticlassAccuracy(num_classes=2, average="micro"),
            "F1": MulticlassF1Score(num_classes=2),
        }


class Recorder(LoggerDestination):
    def __init__(self):
        super().__init__()
        self.logged = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def keys_at(self, prefix):
        return [(step, sorted(m)) for step, m in self.logged if any(k.startswith(prefix) for k in m)]


def _trainer(eval_dataloader, **kw):
    model = Net()
    return kiln.Trainer(
        model,
        train_dataloader=DataLoader(_data(32, 0), batch_size=8),  # 4 batches per epoch
        eval_dataloader=eval_dataloader,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        max_duration="2ep",
        progress_bar=False,
        **kw,
    )


def _reference(model, data):
    """One evaluation by hand: loss and accuracy of the model's current weights on ``data``."""
    x, y = data.tensors
    with torch.no_grad():
        logits = model.net(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def test_two_sets_run_at_their_own_intervals_with_their_own_metrics():
    val, test = _data(20, 1), _data(12, 2)
    recorder = Recorder()
    trainer = _trainer(
        [
            kiln.Evaluator("val", DataLoader(val, batch_size=8), interval="3ba"),
            kiln.Evaluator("test", DataLoader(test, batch_size=8), metrics=["Accuracy"]),  # the Trainer's 1ep
        ],
        loggers=[recorder],
    )
    trainer.fit()
    # val every 3 batches (3, 6); test at each epoch end (4, 8); each with its own metrics
    assert recorder.keys_at("eval/val/") == [
        (step, ["eval/val/Accuracy", "eval/val/F1", "eval/val/loss"]) for step in (3, 6)
    ]
    assert recorder.keys_at("eval/test/") == [(step, ["eval/test/Accuracy", "eval/test/loss"]) for step in (4, 8)]
    assert not [m for _, m in recorder.logged if any(k.startswith("eval/") and k.count("/") == 1 for k in m)]

    # the values are those of one evaluation by hand, each set on its own data
    results = trainer.eval()
    assert set(results) == {"eval/val/loss", "eval/val/Accuracy", "eval/val/F1", "eval/test/loss", "eval/test/Accuracy"}
    for label, data in (("val", val), ("test", test)):
        loss, accuracy = _reference(trainer.state.model, data)
        assert results[f"eval/{label}/loss"] == pytest.approx(loss, rel=1e-6)
        assert results[f"eval/{label}/Accuracy"] == pytest.approx(accuracy)
    # each set has its own metric objects: the test set's accuracy is not the val set's
    metrics = trainer.state.eval_metrics
    assert metrics["eval/val"]["Accuracy"] is not metrics["eval/test"]["Accuracy"]
    assert results["eval/val/Accuracy"] != results["eval/test/Accuracy"]


def test_a_plain_loader_keeps_eval_names_and_a_single_evaluator_is_accepted():
    recorder = Recorder()
    trainer = _trainer(DataLoader(_data(16, 1), batch_size=8), loggers=[recorder], eval_interval="2ba")
    trainer.fit(duration="4ba")
    assert recorder.keys_at("eval/") == [(s, ["eval/Accuracy", "eval/F1", "eval/loss"]) for s in (2, 4)]

    trainer = _trainer(kiln.Evaluator("holdout", DataLoader(_data(16, 1), batch_size=8), metrics={"acc": Accuracy()}))
    assert set(trainer.eval()) == {"eval/holdout/loss", "eval/holdout/acc"}
    # the label "eval" is the default set's: a plain loader's keys, beside named sets
    trainer = _trainer(
        [
            kiln.Evaluator("eval", DataLoader(_data(16, 1), batch_size=8), metrics=["F1"]),
            kiln.Evaluator("ood", DataLoader(_data(16, 2), batch_size=8)),
        ]
    )
    assert set(trainer.eval()) == {
        "eval/loss",
        "eval/F1",
        "eval/ood/loss",
        "eval/ood/Accuracy",
        "eval/ood/F1",
    }
    # eval(loader) of a plain loader still takes label= as its prefix
    assert set(trainer.eval(DataLoader(_data(8, 3), batch_size=8), label="extra")) == {
        "extra/loss",
        "extra/Accuracy",
        "extra/F1",
    }


def test_fit_takes_evaluators_too():
    recorder = Recorder()
    trainer = _trainer(None, loggers=[recorder])
    trainer.fit(
        duration="2ba", eval_dataloader=kiln.Evaluator("late", DataLoader(_data(8, 1), batch_size=8), interval="1ba")
    )
    assert [step for step, _ in recorder.keys_at("eval/late/")] == [1, 2]


def test_the_trainers_interval_is_asked_once_per_event_for_every_set_that_follows_it():
    calls = []

    def every_second_batch(state, event):  # counts its calls, as the config layer's schedule does
        calls.append((state.timestamp.batch.value, event))
        return event == kiln.Event.BATCH_END and state.timestamp.batch.value % 2 == 0

    recorder = Recorder()
    trainer = _trainer(
        [kiln.Evaluator(name, DataLoader(_data(8, 1), batch_size=8)) for name in ("a", "b")],
        loggers=[recorder],
        eval_interval=every_second_batch,
    )
    trainer.fit(duration="4ba")
    assert [step for step, _ in calls if _ == kiln.Event.BATCH_END] == [1, 2, 3, 4]
    assert [step for step, _ in recorder.keys_at("eval/a/")] == [2, 4]
    assert [step for step, _ in recorder.keys_at("eval/b/")] == [2, 4]


def test_best_checkpoint_and_stoppers_watch_one_named_set(tmp_path):
    stopper = EarlyStopper("val/loss", patience="1ba", min_delta=10.0)  # never improves by 10: stops at 3
    trainer = _trainer(
        [
            kiln.Evaluator("val", DataLoader(_data(16, 1), batch_size=8), interval="1ba"),
            kiln.Evaluator("test", DataLoader(_data(16, 2), batch_size=8), interval="1ba"),
        ],
        callbacks=[stopper],
        save_folder=str(tmp_path / "ckpt"),
        save_interval="1ba",
        save_best="eval/val/loss",
    )
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 3, "EarlyStopper watched eval/val/loss"
    assert (tmp_path / "ckpt" / "best").exists()
    manifest = json.loads((tmp_path / "ckpt" / "best" / "manifest.json").read_text())
    assert "eval/val/loss" in json.dumps(manifest)


def test_sets_given_the_same_metric_object_each_compute_their_own():
    shared = Accuracy()
    trainer = _trainer(
        [
            kiln.Evaluator("a", DataLoader(_data(16, 1), batch_size=8), metrics={"acc": shared}),
            kiln.Evaluator("b", DataLoader(_data(16, 5), batch_size=8), metrics=[shared]),
        ]
    )
    results = trainer.eval()
    for label, seed, key in (("a", 1, "acc"), ("b", 5, "Accuracy")):
        assert results[f"eval/{label}/{key}"] == pytest.approx(_reference(trainer.state.model, _data(16, seed))[1])
    assert results["eval/a/acc"] != results["eval/b/Accuracy"]
    assert shared.update_count == 0, "the user's object is copied, never updated"


def test_bad_evaluators_are_refused_with_the_key_and_the_fix():
    loader = DataLoader(_data(8, 1), batch_size=8)
    with pytest.raises(ValueError, match=r"Evaluator 'val' interval='3 batches' is not a time"):
        kiln.Evaluator("val", loader, interval="3 batches")
    with pytest.raises(ValueError, match=r"label=''"):
        kiln.Evaluator("", loader)
    with pytest.raises(ValueError, match=r"Evaluator 'val' metrics=42"):
        kiln.Evaluator("val", loader, metrics=42)
    with pytest.raises(ValueError, match=r"Evaluator 'val' subset_num_batches=0"):
        kiln.Evaluator("val", loader, subset_num_batches=0)
    with pytest.raises(ValueError, match=r"several Evaluators labelled \['val'\]"):
        _trainer([kiln.Evaluator("val", loader), kiln.Evaluator("val", loader)])
    with pytest.raises(TypeError, match="mixes kiln.Evaluators"):
        _trainer([kiln.Evaluator("val", loader), loader])
    trainer = _trainer(kiln.Evaluator("val", loader, metrics=["Acuracy"]))
    with pytest.raises(
        ValueError, match=r"metric 'Acuracy', which the model does not have \(it has \['Accuracy', 'F1'\]\)"
    ):
        trainer.eval()


def test_subset_num_batches_per_set():
    trainer = _trainer(
        [
            kiln.Evaluator("short", DataLoader(_data(24, 1), batch_size=8), subset_num_batches=1),
            kiln.Evaluator("full", DataLoader(_data(24, 1), batch_size=8)),
        ]
    )
    results = trainer.eval()
    data = _data(24, 1)
    first_batch = TensorDataset(*(t[:8] for t in data.tensors))
    assert results["eval/short/loss"] == pytest.approx(_reference(trainer.state.model, first_batch)[0], rel=1e-6)
    assert results["eval/full/loss"] == pytest.approx(_reference(trainer.state.model, data)[0], rel=1e-6)
    assert results["eval/short/loss"] != results["eval/full/loss"]


@pytest.mark.world_size(2)
@pytest.mark.timeout(180)
def test_two_sets_at_different_intervals_on_two_ranks(tmp_path):
    port = free_port()
    env = lambda rank: {
        "RANK": rank,
        "WORLD_SIZE": 2,
        "LOCAL_RANK": rank,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "KILN_TEST_PG_TIMEOUT": 60,
    }
    procs = fork_ranks(WORKERS / "evaluators_worker.py", env, nproc=2, args=(str(tmp_path),), timeout=160)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        # val (9 samples: 2 batches on rank 0, 1 on rank 1) every 2 batches; test (5 samples) every epoch
        assert result["val_steps"] == [2, 4, 6], rank
        assert result["test_steps"] == [3, 6], rank
        for key, ref in result["ref"].items():  # the final evaluation equals one process's
            assert result["final"][key] == pytest.approx(ref, abs=1e-10), (rank, key)
        assert set(result["final"]) == {"eval/val/loss", "eval/val/Accuracy", "eval/test/loss", "eval/test/acc"}
    # each set sharded over the ranks: val's 9 samples are 2 batches on rank 0 and 1 on rank 1 (which
    # pads with a forward whose outputs count nowhere), test's 5 one batch each; in the loop's order
    order = ["val", "test", "val", "val", "test", "val", "test"]  # steps 2, 3, 4, 6, 6 (epoch end), then eval()
    assert ranks[0]["eval_batches"] == [[s, 2 if s == "val" else 1] for s in order]
    assert ranks[1]["eval_batches"] == [[s, 1] for s in order]
    assert ranks[0]["forwards"] == ranks[1]["forwards"], "every rank ran as many eval forwards"
