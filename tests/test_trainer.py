"""Trainer: event order, durations, microbatching, evaluation, stopping, the two model forms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln import Event


def _data(n=64, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


class Recorder(kiln.Callback):
    def __init__(self):
        self.events = []

    def run_event(self, event, state, logger):
        self.events.append(event)


def _trainer(**kw):
    model = kw.pop("model", None) or _mlp()
    args = dict(
        train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=16),
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        progress_bar=False,
    )
    args.update(kw)
    return kiln.Trainer(model, **args)


def test_event_order_two_epochs_with_eval_accumulation_and_checkpoints(tmp_path):
    rec = Recorder()
    trainer = _trainer(
        train_dataloader=torch.utils.data.DataLoader(_data(32), batch_size=16),
        eval_dataloader=torch.utils.data.DataLoader(_data(16), batch_size=16),
        max_duration="2ep",
        grad_accum=2,
        callbacks=[rec],
    )
    trainer.fit()
    micro = [
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    ]
    batch = [
        Event.BEFORE_DATALOADER,
        Event.AFTER_DATALOADER,
        Event.BATCH_START,
        Event.BEFORE_TRAIN_BATCH,
        *micro,
        *micro,
        Event.AFTER_TRAIN_BATCH,
        Event.BEFORE_OPTIMIZER_STEP,
        Event.BATCH_END,
        Event.BATCH_CHECKPOINT,
    ]
    evaluation = [
        Event.EVAL_START,
        Event.EVAL_BATCH_START,
        Event.EVAL_BEFORE_FORWARD,
        Event.EVAL_AFTER_FORWARD,
        Event.EVAL_BATCH_END,
        Event.EVAL_END,
    ]
    epoch = [
        Event.EPOCH_START,
        *batch,
        *batch,
        Event.BEFORE_DATALOADER,
        Event.EPOCH_END,
        *evaluation,
        Event.EPOCH_CHECKPOINT,
    ]
    assert rec.events == [Event.INIT, Event.FIT_START, *epoch, *epoch, Event.FIT_END]


def test_load_events_fire_when_loading(tmp_path):
    rec = Recorder()
    first = _trainer(max_duration="1ep", save_folder=str(tmp_path / "ck"))
    first.fit()
    _trainer(max_duration="2ep", save_folder=str(tmp_path / "ck"), load_path="last", callbacks=[rec])
    assert rec.events[:3] == [Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD]


@pytest.mark.parametrize(
    "duration,batches,epochs,samples",
    [
        ("3ep", 12, 3, 192),
        (2, 8, 2, 128),
        ("6ba", 6, 1, 96),
        ("100sp", 7, 1, 112),
        ("1ep", 4, 1, 64),
    ],
)
def test_durations_stop_at_the_right_batch(duration, batches, epochs, samples):
    trainer = _trainer(max_duration=duration)
    trainer.fit()
    ts = trainer.state.timestamp
    assert (ts.batch.value, ts.epoch.value, ts.sample.value) == (batches, epochs, samples)


def test_fit_duration_adds_to_the_run_and_dur_fractions_resolve():
    trainer = _trainer(max_duration="2ep")
    assert trainer.state.resolve("0.5dur") == kiln.Time(1, "ep")
    trainer.fit(duration="3ba")
    assert trainer.state.timestamp.batch.value == 3
    trainer.fit(duration="2ba")
    assert trainer.state.timestamp.batch.value == 5


def test_eval_interval_in_batches_and_dur():
    rec = Recorder()
    trainer = _trainer(
        max_duration="2ep",
        eval_dataloader=torch.utils.data.DataLoader(_data(16), batch_size=8),
        eval_interval="3ba",
        callbacks=[rec],
    )
    trainer.fit()
    assert rec.events.count(Event.EVAL_START) == 2  # after batches 3 and 6 of 8
    rec2 = Recorder()
    trainer = _trainer(
        max_duration="8ba",
        eval_dataloader=torch.utils.data.DataLoader(_data(16), batch_size=8),
        eval_interval="0.25dur",
        callbacks=[rec2],
    )
    trainer.fit()
    assert rec2.events.count(Event.EVAL_START) == 4


def test_grad_accum_and_microbatch_size_match_full_batch():
    ref = _trainer(max_duration="1ep")
    ref.fit()
    for kw in ({"grad_accum": 4}, {"device_train_microbatch_size": 4}):
        other = _trainer(max_duration="1ep", **kw)
        other.fit()
        for a, b in zip(ref.state.model.parameters(), other.state.model.parameters()):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)


class OOMAbove(nn.Module):
    """Raises torch.OutOfMemoryError when a batch has more than `limit` samples, as a GPU would."""

    def __init__(self, limit):
        super().__init__()
        self.limit = limit
        self.net = _mlp()

    def forward(self, x):
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"fake OOM at {x.shape[0]} samples")
        return self.net(x)


def test_auto_microbatching_halves_on_oom_and_matches_given_size():
    auto = _trainer(model=OOMAbove(4), max_duration="1ep", device_train_microbatch_size="auto")
    auto.fit()
    assert auto.options.microbatching.microbatch == 4
    fixed = _trainer(model=OOMAbove(4), max_duration="1ep", device_train_microbatch_size=4)
    fixed.fit()
    for a, b in zip(auto.state.model.parameters(), fixed.state.model.parameters()):
        assert torch.equal(a, b)


def test_kiln_model_with_metrics_and_eval():
    torchmetrics = pytest.importorskip("torchmetrics")

    class Net(kiln.Model):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def forward(self, batch):
            return self.net(batch[0])

        def loss(self, outputs, batch):
            return nn.functional.cross_entropy(outputs, batch[1])

        def get_metrics(self, is_train=False):
            return {"Accuracy": torchmetrics.classification.MulticlassAccuracy(num_classes=2, average="micro")}

    model = Net()
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=16),
        eval_dataloader=torch.utils.data.DataLoader(_data(32, seed=1), batch_size=8),
        max_duration="3ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.05),
        progress_bar=False,
    )
    trainer.fit()
    results = trainer.eval()
    x, y = _data(32, seed=1).tensors
    with torch.no_grad():
        logits = model.net(x)
    expected_acc = (logits.argmax(1) == y).float().mean().item()
    expected_loss = nn.functional.cross_entropy(logits, y).item()
    assert results["eval/Accuracy"] == pytest.approx(expected_acc, abs=1e-6)
    assert results["eval/loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert trainer.state.metrics["eval/Accuracy"] == results["eval/Accuracy"]
    preds = trainer.predict(torch.utils.data.DataLoader(_data(32, seed=1), batch_size=8))
    assert torch.allclose(torch.cat(preds), logits)


def test_stop_training_ends_the_run_cleanly():
    class StopAt3(kiln.Callback):
        def batch_end(self, state, logger):
            if state.timestamp.batch.value == 3:
                state.stop_training("enough")

    rec = Recorder()
    trainer = _trainer(max_duration="5ep", callbacks=[StopAt3(), rec])
    trainer.fit()
    assert trainer.state.timestamp.batch.value == 3 and trainer.state.stop_reason == "enough"
    assert rec.events[-1] == Event.FIT_END


_BATCH = [
    Event.BEFORE_DATALOADER,
    Event.AFTER_DATALOADER,
    Event.BATCH_START,
    Event.BEFORE_TRAIN_BATCH,
    Event.BEFORE_FORWARD,
    Event.AFTER_FORWARD,
    Event.BEFORE_LOSS,
    Event.AFTER_LOSS,
    Event.BEFORE_BACKWARD,
    Event.AFTER_BACKWARD,
    Event.AFTER_TRAIN_BATCH,
    Event.BEFORE_OPTIMIZER_STEP,
    Event.BATCH_END,
    Event.BATCH_CHECKPOINT,
]


class _AtBatch(kiln.Callback):
    """At the BATCH_END of batch ``number``, calls ``change()``; listens to nothing else."""

    def __init__(self, number, change):
        self.number, self.change = number, change

    def batch_end(self, state, logger):
        if state.timestamp.batch.value == self.number:
            self.change()


def test_a_callback_added_mid_fit_by_another_gets_the_events_from_the_next_one_on():
    rec = Recorder()
    trainer = _trainer(max_duration="4ba")
    adder = _AtBatch(2, lambda: trainer.events.add(rec))
    trainer.events.add(adder)
    trainer.fit()
    # Nothing listened to the in-batch events before: they run for rec from batch 3 on all the same.
    assert rec.events == [Event.BATCH_CHECKPOINT, *_BATCH, *_BATCH, Event.FIT_END]
    assert trainer.state.callbacks == [adder, rec]


def test_a_callback_removed_mid_fit_gets_no_event_after_the_current_one():
    rec = Recorder()

    def remove_both():
        trainer.events.remove(rec)
        trainer.events.remove(remover)  # a callback may remove itself too

    remover = _AtBatch(2, remove_both)
    trainer = _trainer(max_duration="4ba", callbacks=[remover, rec])
    trainer.fit()
    # The BATCH_END running when rec was removed finishes with the callbacks it started with.
    assert rec.events == [Event.INIT, Event.FIT_START, Event.EPOCH_START, *_BATCH, *_BATCH[:-1]]
    assert trainer.state.callbacks == [] and trainer.state.timestamp.batch.value == 4
    assert Event.BATCH_END not in trainer.events.active  # nobody listens now: the loop skips it again


def test_algorithms_run_before_callbacks_and_reverse_on_after_events():
    calls = []

    class Alg(kiln.Algorithm):
        def __init__(self, name):
            self.name = name

        def match(self, event, state):
            return event in (Event.BEFORE_FORWARD, Event.AFTER_FORWARD)

        def apply(self, event, state, logger):
            calls.append((self.name, event))

    class Cb(kiln.Callback):
        def before_forward(self, state, logger):
            calls.append(("cb", Event.BEFORE_FORWARD))

    _trainer(max_duration="1ba", algorithms=[Alg("a"), Alg("b")], callbacks=[Cb()]).fit()
    assert calls == [
        ("a", Event.BEFORE_FORWARD),
        ("b", Event.BEFORE_FORWARD),
        ("cb", Event.BEFORE_FORWARD),
        ("b", Event.AFTER_FORWARD),
        ("a", Event.AFTER_FORWARD),
    ]


def test_seed_makes_runs_identical_and_deterministic_flag():
    def run():
        torch.manual_seed(0)  # the model is built before the Trainer seeds anything
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 2))
        t = kiln.Trainer(
            model,
            train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=16, shuffle=True),
            max_duration="2ep",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            seed=3,
            progress_bar=False,
            deterministic=True,
        )
        t.fit()
        return [p.detach().clone() for p in model.parameters()]

    try:
        a, b = run(), run()
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_plain_shuffled_dataloader_gets_a_seedable_sampler():
    trainer = _trainer(
        train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=16, shuffle=True), max_duration="1ep", seed=5
    )
    assert isinstance(trainer.train_dataloader.sampler, kiln.launch.ResumableSampler)
    assert trainer.train_dataloader.sampler.seed == 5


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_duration": "10eps"}, "10eps"),
        ({"max_duration": "0.5dur"}, "cannot be a fraction of itself"),
        ({"grad_accum": 0}, "grad_accum=0 must be an integer >= 1"),
        ({"device_train_microbatch_size": "big"}, "device_train_microbatch_size='big'"),
        ({"eval_interval": "3sp"}, "eval_interval='3sp' must be"),
        ({"save_type": "zip"}, "save_type='zip' is not known"),
        ({"precision": "fp8"}, "precision='fp8' is not known"),
        ({"strategy": "nope"}, "strategy='nope' is not known"),
        ({"log_interval": "1ep"}, "log_interval='1ep'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _trainer(**kwargs)


def test_plain_module_needs_criterion():
    with pytest.raises(ValueError, match="pass criterion="):
        kiln.Trainer(_mlp(), max_duration=1)


def test_no_duration_is_an_error():
    with pytest.raises(ValueError, match="no duration"):
        _trainer().fit()


def test_clip_grad_norm_and_gradient_clipping_algorithm_are_exclusive():
    from kiln.algorithms import GradientClipping

    with pytest.raises(ValueError, match="clip_grad_norm= and the GradientClipping algorithm"):
        _trainer(
            max_duration=1,
            clip_grad_norm=1.0,
            algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=1.0)],
        )


def test_two_rank_ddp_logs_the_mean_loss_counts_all_samples_and_matches_one_process(tmp_path):
    import json

    from distributed import WORKERS, check, fork_run

    check(fork_run(WORKERS / "trainer_ddp.py", str(tmp_path)))
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    train = [entry["metrics"]["train/loss"] for entry in logged if "train/loss" in entry.get("metrics", {})]
    assert train == pytest.approx([(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])], rel=1e-6)
    assert (r0["batches"], r0["samples"]) == (8, 128)  # 2 epochs of 64 samples, counted over both ranks
    assert r0["weights"] == r1["weights"]
    # One process with the global batch (both ranks' samples of each step) gives the same weights.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        sampler = [
            torch.utils.data.DistributedSampler(
                torch.utils.data.TensorDataset(x), num_replicas=2, rank=r, shuffle=True, seed=11
            )
            for r in range(2)
        ]
        for s in sampler:
            s.set_epoch(epoch)
        orders = [list(s) for s in sampler]
        for step in range(4):
            idx = [orders[r][step * 8 : (step + 1) * 8] for r in range(2)]
            opt.zero_grad()
            loss = sum(nn.functional.cross_entropy(model(x[i]), y[i]) for i in idx) / 2
            loss.backward()
            opt.step()
    for k, v in model.state_dict().items():
        assert torch.allclose(torch.tensor(r0["weights"][k]), v, atol=1e-6), k


def test_resume_is_exact_when_eval_and_checkpoint_share_a_step(tmp_path):
    """Eval draws from the global RNG (its DataLoader's seed); it runs before the checkpoint, so a
    resumed run continues from the same RNG state as an uninterrupted one."""

    def make(max_duration, **kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 2))
        return kiln.Trainer(
            model,
            train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=True),
            eval_dataloader=torch.utils.data.DataLoader(_data(16, seed=1), batch_size=8, shuffle=True),
            max_duration=max_duration,
            eval_interval="3ba",
            optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
            criterion=nn.CrossEntropyLoss(),
            seed=4,
            progress_bar=False,
            **kw,
        )

    full = make("14ba")
    full.fit()
    first = make("6ba", save_folder=str(tmp_path), save_interval="3ba", save_type="merged")
    first.fit()
    resumed = make("14ba", save_folder=str(tmp_path), save_interval="3ba", save_type="merged", load_path="last")
    assert resumed.state.timestamp.batch.value == 6
    resumed.fit()
    for a, b in zip(full.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)
    assert full.state.metrics["eval/loss"] == resumed.state.metrics["eval/loss"]


def test_fit_with_reset_time_starts_time_and_data_again_from_epoch_zero():
    class Seen(kiln.Callback):
        def __init__(self):
            self.batches = []

        def after_dataloader(self, state, logger):
            self.batches.append(state.batch[0][:, 0].tolist())

    def run(*durations, reset=False):
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        seen = Seen()
        trainer = kiln.Trainer(
            model,
            train_dataloader=torch.utils.data.DataLoader(_data(), batch_size=8, shuffle=True),
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            callbacks=[seen],
            progress_bar=False,
            seed=3,
        )
        trainer.fit(duration=durations[0])
        first = len(seen.batches)
        for duration in durations[1:]:
            trainer.fit(duration=duration, reset_time=reset)
        return seen.batches[:first], seen.batches[first:], trainer

    fresh, _, _ = run("5ba")
    before, after, trainer = run("3ba", "5ba", reset=True)
    assert before == fresh[:3] and after == fresh  # epoch 0's order again, from its first batch
    assert trainer.state.timestamp.batch.value == 5 and trainer.state.timestamp.batch_in_epoch.value == 5


def test_the_last_steps_outputs_are_not_kept_alive_through_the_next_forward():
    # Holding state.outputs into the next forward kept one extra logits tensor alive at the peak
    # (benchmarks/lm.py measured it: 1 MiB on the small Llama).
    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)
            self.previous_alive: list[bool] = []
            self.state = None

        def forward(self, x):
            if self.state is not None:
                self.previous_alive.append(self.state.outputs is not None)
            return self.lin(x)

    model = Probe()
    data = [(torch.randn(3, 4), torch.randint(0, 2, (3,))) for _ in range(4)]
    trainer = kiln.Trainer(
        model,
        train_dataloader=data,
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        max_duration="1ep",
        progress_bar=False,
    )
    model.state = trainer.state
    trainer.fit()
    assert model.previous_alive == [False] * 4
    assert trainer.state.outputs is not None  # after the step, callbacks and users still see them
