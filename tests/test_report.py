"""`kiln report`: real Trainer runs (File and TensorBoard loggers, checkpoints, a resume from an
earlier checkpoint) turned into report.html and PNGs; the PNGs hold curves, not empty axes; two
runs overlay; Chromium renders the page (skipped without it unless KILN_TEST_REQUIRE names it)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from torch import nn

from kiln.cli.main import main
from kiln.report import RunError, load_run
from kiln.report.plots import PALETTE

matplotlib = pytest.importorskip("matplotlib")  # the `report` extra
pytest.importorskip("tensorboard")

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
# tab10's first two colours: the train loss of a single run, and run B's colour in an overlay
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)
# What a run of _train shows on each figure, in drawing order (the memory figure's keys vary with
# the device: see _expected_curves)
CURVES = {
    "loss": ["train/loss", "eval/loss"],
    "learning_rate": ["lr-SGD/group0"],
    "throughput": ["throughput/samples_per_sec"],
    "flops": ["throughput/device/flops_per_sec"],
    "mfu": ["throughput/mfu"],
    "eval-Accuracy": ["eval/Accuracy"],
}
BATCHES_PER_EPOCH = 8


def _train(folder: Path, *, epochs: int, load_path=None, seed: int = 0, lr: float = 0.3) -> None:
    """One process's share of a run: 5 epochs planned, `epochs` of them done in this fit."""
    import kiln
    from kiln import callbacks, metrics
    from kiln.loggers import FileLogger, TensorBoardLogger
    from kiln.optim.schedulers import CosineAnnealingWithWarmupScheduler

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, (x[:, :4] + 0.5 * x[:, 4:8]).argmax(1))
    loader = torch.utils.data.DataLoader(data, batch_size=128 // BATCHES_PER_EPOCH)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    trainer = kiln.Trainer(
        model,
        train_dataloader=loader,
        eval_dataloader=loader,
        max_duration="5ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        schedulers=CosineAnnealingWithWarmupScheduler(t_warmup="1ep", t_max="5ep", alpha_f=0.1),
        criterion=nn.CrossEntropyLoss(),
        eval_metrics={"Accuracy": metrics.Accuracy()},
        callbacks=[
            callbacks.LRMonitor(),
            callbacks.SpeedMonitor(window_size=4, peak_flops_per_sec=1e9),
            callbacks.MemoryMonitor(),
        ],
        loggers=[FileLogger(folder / "metrics.jsonl"), TensorBoardLogger(folder / "tb")],
        save_folder=folder / "checkpoints",
        save_interval="1ep",
        load_path=load_path,
        progress_bar=False,
        seed=seed,
    )
    trainer.fit(duration=f"{epochs}ep")
    trainer.close()


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    """3 epochs, then a second process resumes from the epoch-2 checkpoint and finishes epochs 3-5
    (epoch 3 is trained and logged twice; the report keeps the second)."""
    folder = tmp_path_factory.mktemp("run_a")
    _train(folder, epochs=3)
    _train(folder, epochs=3, load_path=folder / "checkpoints" / f"ep2-ba{2 * BATCHES_PER_EPOCH}")
    return folder


@pytest.fixture(scope="module")
def run_b(tmp_path_factory) -> Path:
    """Another seed and learning rate, in one process."""
    folder = tmp_path_factory.mktemp("run_b")
    _train(folder, epochs=5, seed=1, lr=0.1)
    return folder


def _rgb(colour) -> tuple[int, int, int]:
    """A matplotlib colour ("#1f77b4", or an RGB tuple of floats) in 0-255 integers."""
    return tuple(round(255 * c) for c in matplotlib.colors.to_rgb(colour))


def _pixels(png: Path):
    image = matplotlib.image.imread(png)  # floats in [0, 1], RGB or RGBA
    return (image[..., :3] * 255).round().astype(int)


def _columns_with(png: Path, colour: tuple[int, int, int], tolerance: int = 40) -> int:
    """How many pixel columns hold the colour: a curve spans the axis, a vertical line or a legend
    swatch only a few columns."""
    import numpy as np

    distance = np.abs(_pixels(png) - np.array(colour)).sum(axis=-1)
    return int((distance <= tolerance).any(axis=0).sum())


def _report(*args: str) -> int:
    return main(["report", *map(str, args)])


class Curve(NamedTuple):
    label: str
    colour: tuple[int, int, int]
    style: str
    steps: list[float]
    values: list[float]


@pytest.fixture
def drawn(monkeypatch) -> dict[str, list[Curve]]:
    """The curves on each figure `kiln report` saves (by file stem), in drawing order: the lines in
    data coordinates, not the checkpoint and resume marks (vertical lines across the axes)."""
    from matplotlib.figure import Figure

    figures: dict[str, list[Curve]] = {}
    savefig = Figure.savefig

    def spy(figure, fname, *args, **kwargs):
        (ax,) = figure.axes
        figures[Path(fname).stem] = [
            Curve(
                line.get_label(),
                _rgb(line.get_color()),
                line.get_linestyle(),
                [float(x) for x in line.get_xdata()],
                [float(y) for y in line.get_ydata()],
            )
            for line in ax.get_lines()
            if line.get_transform() is ax.transData
        ]
        return savefig(figure, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


# The memory figure of a run on CUDA: the allocator's allocated and reserved memory, current and
# peak, in this order (its active and inactive memory and alloc_retries go to the page's table)
CUDA_MEMORY = [
    "memory/current_allocated_mem",
    "memory/peak_allocated_mem",
    "memory/current_reserved_mem",
    "memory/peak_reserved_mem",
]


def _expected_curves(run) -> dict[str, list[str]]:
    """CURVES, with the memory figure's keys: CUDA_MEMORY on a GPU, the process's RSS on the CPU."""
    memory = [key for key in CUDA_MEMORY if key in run.series] or sorted(
        key for key in run.series if key.startswith("memory/") and key != "memory/alloc_retries"
    )
    assert memory, sorted(run.series)
    return {**CURVES, "memory": memory}


def _assert_curve_is(curve: Curve, series, stem: str) -> None:
    """The curve shows the series: its steps, and its values times the figure's scale (MFU in
    percent; FLOP/s in the largest unit of 1000 that keeps the peak at least 1)."""
    assert curve.steps == series.steps, (stem, curve.label)
    scale = {"mfu": 100.0}.get(stem, 1.0)
    if stem == "flops":
        scale = curve.values[0] / series.values[0]
        assert any(scale == pytest.approx(10.0**-e) for e in (0, 3, 6, 9, 12)), scale
    assert curve.values == pytest.approx([v * scale for v in series.values], rel=1e-9), (stem, curve.label)


def test_markers_and_resume_history_are_read_from_both_log_kinds(run_a):
    n = BATCHES_PER_EPOCH
    jsonl = load_run(run_a / "metrics.jsonl")
    events = load_run(run_a / "tb")
    assert (jsonl.source, events.source) == ("jsonl", "tensorboard")
    for run in (jsonl, events):
        # checkpoints at every epoch end; the first process's epoch-3 one belongs to a branch the
        # resume abandoned, and the second process saved its own at the same step
        assert run.checkpoints == [n, 2 * n, 3 * n, 4 * n, 5 * n]
        assert run.resumes == [2 * n]
        loss = run.series["train/loss"]
        assert loss.steps == list(range(1, 5 * n + 1))  # each step once, although 17-24 ran twice
        assert run.series["eval/loss"].steps == [n, 2 * n, 3 * n, 4 * n, 5 * n]
        for key in ("eval/Accuracy", "lr-SGD/group0", "throughput/samples_per_sec", "throughput/mfu"):
            assert len(run.series[key]) > 0, key
        assert any(key.startswith("memory/") for key in run.series)
    # The two loggers saw the same values (TensorBoard stores float32).
    for key in ("train/loss", "eval/loss", "lr-SGD/group0"):
        assert jsonl.series[key].values == pytest.approx(events.series[key].values, rel=1e-6)
    # Epoch 3 was logged twice (the first process ran it, then the second again from the epoch-2
    # checkpoint): 48 train/loss records, 40 steps kept, each the value written last.
    records = [json.loads(line) for line in (run_a / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["metrics"]["train/loss"]) for r in records if "train/loss" in r.get("metrics", {})]
    assert len(losses) == 6 * n
    assert jsonl.series["train/loss"].values == pytest.approx([dict(losses)[s] for s in range(1, 5 * n + 1)])


def test_a_resume_replaces_what_was_logged_after_its_checkpoint(tmp_path):
    """A process logs to step 6 (checkpoints at 3 and 6, an evaluation at 6) and dies in a line's
    middle; the next resumes from step 3 and logs 4 to 8 again. The history that went on is kept."""
    lines = [{"hyperparameters": {"lr": 0.1}}]
    lines += [{"step": s, "metrics": {"train/loss": 10.0 + s}} for s in range(1, 7)]
    lines.insert(4, {"step": 3, "metrics": {"checkpoint/saved": 1}})
    lines += [{"step": 6, "metrics": {"eval/loss": 5.0}}, {"step": 6, "metrics": {"checkpoint/saved": 1}}]
    lines += [{"step": 3, "metrics": {"checkpoint/resumed": 1}}]
    lines += [{"step": s, "metrics": {"train/loss": 20.0 + s}} for s in range(4, 9)]
    lines += [{"step": 8, "metrics": {"checkpoint/saved": 1}}, {"step": None, "metrics": {"extra": 1.5}}]
    text = "\n".join(json.dumps(line) for line in lines)
    first, second = text.split('{"step": 3, "metrics": {"checkpoint/resumed"')
    (tmp_path / "metrics.jsonl").write_text(
        first + '{"step": 7, "metr\n{"step": 3, "metrics": {"checkpoint/resumed"' + second
    )
    run = load_run(tmp_path)
    loss = run.series["train/loss"]
    assert loss.steps == [1, 2, 3, 4, 5, 6, 7, 8]
    assert loss.values == [11, 12, 13, 24, 25, 26, 27, 28]
    assert "eval/loss" not in run.series  # the evaluation at 6 belongs to the abandoned branch
    assert run.checkpoints == [3, 8] and run.resumes == [3]
    assert run.num_skipped_lines == 1
    assert "checkpoint/saved" not in run.series and "checkpoint/resumed" not in run.series
    assert run.series["extra"].steps == [len(lines) - 2]  # no step: the count of metric records before it


def test_report_writes_html_and_pngs_with_curves(run_a, tmp_path, drawn):
    out = tmp_path / "report"
    assert _report(run_a, "--out", out) == 0
    page = (out / "report.html").read_text()
    pngs = {p.stem for p in out.glob("*.png")}
    run = load_run(run_a / "metrics.jsonl")
    expected = _expected_curves(run)
    assert pngs == set(expected) == set(drawn)
    # Every metric of each figure is a curve on it, in its own tab10 colour, solid.
    for stem, keys in expected.items():
        assert [curve.label for curve in drawn[stem]] == keys, stem
        for m, (key, curve) in enumerate(zip(keys, drawn[stem])):
            assert curve.colour == _rgb(PALETTE[m]) and curve.style == "-", (stem, key)
            _assert_curve_is(curve, run.series[key], stem)
    # Self-contained: every figure embedded as a data URI, the same bytes as the PNG beside it.
    embedded = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert len(embedded) == len(pngs)
    assert base64.b64decode(embedded[0]) == (out / "loss.png").read_bytes()
    assert not re.search(r'(src|href)="(?!data:)', page), "the page refers to another file"
    # In the PNGs each curve's colour spans the axis (an evaluation's 5 points too), not an empty
    # axis. Not the memory figure's later curves: peak RSS can equal current RSS at every step,
    # and the first curve is drawn on top.
    for stem, keys in expected.items():
        for m in range(1 if stem == "memory" else len(keys)):
            assert _columns_with(out / f"{stem}.png", _rgb(PALETTE[m])) > 300, (stem, keys[m])
    # The summary names the checkpoints and the resume.
    assert "8, 16, 24, 32, 40" in page and ">16<" in page


def test_report_reads_tensorboard_when_there_are_no_json_lines(run_a, tmp_path):
    only_tb = tmp_path / "tb_only"
    shutil.copytree(run_a / "tb", only_tb / "tb")
    assert _report(only_tb) == 0  # default: RUN/report
    assert _columns_with(only_tb / "report" / "loss.png", BLUE) > 300  # train/loss
    assert _columns_with(only_tb / "report" / "loss.png", ORANGE) > 300  # eval/loss
    assert "TensorBoard" in (only_tb / "report" / "report.html").read_text()


def test_two_runs_overlay(run_a, run_b, tmp_path, drawn):
    out = tmp_path / "compare"
    assert _report(run_a, run_b, "--out", out, "--name", "A", "--name", "B") == 0
    for stem in ("loss", "learning_rate", "eval-Accuracy"):
        png = out / f"{stem}.png"
        assert _columns_with(png, BLUE) > 300 and _columns_with(png, ORANGE) > 300, stem
    # Every figure holds each run's every metric: the run's colour, one line style per metric.
    runs = {"A": load_run(run_a / "metrics.jsonl"), "B": load_run(run_b / "metrics.jsonl")}
    expected = _expected_curves(runs["A"])
    assert _expected_curves(runs["B"]) == expected and set(drawn) == set(expected)
    for stem, keys in expected.items():
        assert [curve.label for curve in drawn[stem]] == [f"{name}: {key}" for name in runs for key in keys], stem
        for curve in drawn[stem]:
            name, _, key = curve.label.partition(": ")
            assert curve.colour == {"A": BLUE, "B": ORANGE}[name], curve.label
            assert curve.style == ["-", "--", ":", "-."][keys.index(key)], curve.label
            _assert_curve_is(curve, runs[name].series[key], stem)
    page = (out / "report.html").read_text()
    assert "kiln report: A, B (overlay)" in page


def test_cuda_memory_is_drawn_and_its_peaks_summarised(tmp_path, drawn):
    """A run's log with every series MemoryMonitor writes on CUDA (GB; alloc_retries a count)."""
    steps = range(1, 7)
    allocated = [2.0, 9.5, 4.0, 12.5, 3.0, 6.0]
    reserved = [4.0, 11.0, 11.0, 14.0, 14.0, 14.0]
    series = {
        "memory/current_allocated_mem": allocated,
        "memory/peak_allocated_mem": [max(allocated[:s]) for s in steps],
        "memory/current_reserved_mem": reserved,
        "memory/peak_reserved_mem": reserved,
        "memory/current_active_mem": allocated,
        "memory/peak_active_mem": [max(allocated[:s]) for s in steps],
        "memory/current_inactive_mem": [0.5] * 6,
        "memory/peak_inactive_mem": [0.75] * 6,
        "memory/alloc_retries": [0.0, 0.0, 1.0, 1.0, 1.0, 2.0],
    }
    lines = [{"step": s, "metrics": {"train/loss": 1.0 / s, **{k: v[s - 1] for k, v in series.items()}}} for s in steps]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    out = tmp_path / "report"
    assert _report(tmp_path / "metrics.jsonl", "--out", out) == 0
    assert [curve.label for curve in drawn["memory"]] == CUDA_MEMORY
    for m, curve in enumerate(drawn["memory"]):
        assert curve.steps == list(map(float, steps)) and curve.values == series[CUDA_MEMORY[m]]
        assert curve.colour == _rgb(PALETTE[m])
    page = (out / "report.html").read_text()
    assert "<th>peak memory (GB)</th>" in page and "<td>allocated 12.5, reserved 14</td>" in page
    table = page.split("<h2>Other metrics</h2>")[1]
    others = ["alloc_retries", "current_active_mem", "current_inactive_mem", "peak_active_mem", "peak_inactive_mem"]
    assert re.findall(r"<td>memory/(\w+)</td>", table) == others


@pytest.mark.parametrize(
    "case, message",
    [("missing", "no such file or folder"), ("empty", "no File logger"), ("no_metrics", "hold no metrics")],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys, case, message):
    run = tmp_path / "run"
    if case != "missing":
        run.mkdir()
    if case == "no_metrics":
        (run / "metrics.jsonl").write_text('{"hyperparameters": {"lr": 0.1}}\n')
    out = tmp_path / "out"
    assert _report(run, "--out", out) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not out.exists() and not (run / "report").exists()
    with pytest.raises(RunError):
        load_run(run)


def test_missing_matplotlib_is_one_line_and_exit_2(run_a, tmp_path):
    # A child process in which matplotlib cannot be imported.
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from kiln.cli.main import main\n"
        f"sys.exit(main(['report', {str(run_a)!r}, '--out', {str(tmp_path / 'out')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == "kiln report needs matplotlib: pip install 'kiln-train[report]'"
    assert not (tmp_path / "out").exists()


def test_chromium_renders_the_report(run_a, run_b, tmp_path):
    if not os.path.exists(CHROMIUM):
        if "chromium" in os.environ.get("KILN_TEST_REQUIRE", "").split(","):
            pytest.fail(f"KILN_TEST_REQUIRE names chromium but {CHROMIUM} is missing: apt-get install chromium")
        pytest.skip(f"{CHROMIUM} is not installed")
    out = tmp_path / "report"
    assert _report(run_a, "--out", out) == 0
    shot = tmp_path / "screenshot.png"
    command = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
        (out / "report.html").as_uri(),
    ]
    subprocess.run(command, capture_output=True, timeout=120, check=True, env={**os.environ, "HOME": str(tmp_path)})
    assert shot.exists()
    if os.environ.get("KILN_REPORT_SCREENSHOT"):  # a copy to look at
        shutil.copy(shot, os.environ["KILN_REPORT_SCREENSHOT"])
    # Not blank: the page's dark header, and the figures' curves came through the browser.
    pixels = _pixels(shot)
    assert (pixels[:40].sum(axis=-1) < 200).mean() > 0.5, "no header"
    assert _columns_with(shot, BLUE) > 300, "no curves in the screenshot"


def test_each_evaluation_metric_gets_one_panel_with_every_set_on_it():
    from kiln.report.plots import panels_for
    from kiln.report.runs import Run, Series

    keys = ["train/loss", "train/lr", "eval/loss", "eval/Accuracy", "eval/val/loss", "eval/val/Accuracy"]
    keys += ["eval/test/Perplexity", "lr-SGD/group0", "throughput/mfu", "layer_freezing/num_frozen"]
    run = Run("a", Path("."), "jsonl", [], {k: Series([1.0], [1.0]) for k in keys}, [], [])
    panels, other = panels_for([run])
    metrics = {panel.stem: panel.metrics for panel in panels}
    assert metrics == {
        "loss": ("train/loss", "eval/loss", "eval/val/loss"),
        "learning_rate": ("lr-SGD/group0",),  # train/lr repeats group 0
        "mfu": ("throughput/mfu",),
        "eval-Accuracy": ("eval/Accuracy", "eval/val/Accuracy"),
        "eval-Perplexity": ("eval/test/Perplexity",),
    }
    assert other == ["layer_freezing/num_frozen"]  # listed in the page's table
