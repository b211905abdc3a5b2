"""Optional packages load only for the feature that needs them, and a run prints no foreign warnings
kiln can prevent (issue 23).

Each check runs in a fresh interpreter of its own and reads its ``sys.modules`` and stderr:

* ``import kiln`` imports no optional package (nor torch), nor do ``kiln --help`` and ``kiln --version``;
* a plain Trainer run (fit, a checkpoint, the console logger) imports none either; only
  ``float8=`` imports torchao;
* a Hugging Face run prints none of the warnings torchao logs while transformers imports it
  (transformers 5 imports torchao whenever it is installed: kiln cannot stop that import, only its
  noise), and torchao's warnings after its import still show: one interpreter for both, the run
  first, then warnings logged through torchao's logger (its import, ~8 CPU-s, paid once).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from distributed import base_env

# packages kiln uses only when a feature asks for them (pyproject's extras and integrations)
OPTIONAL = [
    "torchao",
    "transformers",
    "datasets",
    "torchdata",
    "tensorboard",
    "wandb",
    "mlflow",
    "fsspec",
    "s3fs",
    "matplotlib",
    "deepspeed",
    "torchft",
]
TORCHAO_IMPORT_NOISE = ("Failed to load", "_C_mxfp8", "is an Enum subclass", "Skipping import of cpp extensions")


def _run(code: str, tmp_path, marked: bool = False) -> tuple:
    """Run ``code`` in a new interpreter; returns (the JSON it printed last, its stderr), or with
    ``marked``, a list of the JSON of every line it printed after ``loaded:``."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if marked:
        lines = [line.removeprefix("loaded:") for line in result.stdout.splitlines() if line.startswith("loaded:")]
        return [json.loads(line) for line in lines], result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def _needs(package: str) -> None:
    """Skip without the package; not importorskip: its import here (torchao ~3 CPU-s) proves nothing,
    the checks import it in their own interpreters."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed")


LOADED = f"json.dumps(sorted({{n.split('.')[0] for n in sys.modules}} & set({OPTIONAL!r} + ['torch'])))"


def test_import_kiln_imports_no_optional_package(tmp_path):
    loaded, _ = _run(f"import json, sys, kiln; print({LOADED})", tmp_path)
    assert loaded == []


def test_kiln_help_and_version_import_no_torch(tmp_path):
    # `kiln --help` and `kiln --version` answer in a fraction of a second: no torch import (~4
    # CPU-s), nor any optional package (kiln.cli.train imports kiln.launch, hence torch, only to run)
    code = f"""
        import contextlib, io, json, sys
        from kiln.cli.main import main
        for flag in ("--help", "--version"):
            with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
                main([flag])
            assert out.getvalue().startswith(("usage: kiln", "kiln ")), out.getvalue()
        print({LOADED})
    """
    loaded, _ = _run(code, tmp_path)
    assert loaded == []


def _plain_runs(with_float8: bool) -> str:
    """A plain fit, then (with_float8) one with ``float8=``, in ONE interpreter: a line of what was
    loaded after each (the first is taken before the float8 run exists, so it is the plain run's
    alone; one interpreter's torch and kiln imports instead of two)."""
    fit = """
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        batches = [(torch.randn(16, 16), torch.randn(16, 16))] * 2
        trainer = kiln.Trainer(model, criterion=nn.MSELoss(), train_dataloader=batches, max_duration="2ba",
                               optimizers=torch.optim.SGD(model.parameters(), lr=0.1), save_folder={folder!r},
                               loggers=[kiln.loggers.ConsoleLogger()], float8={float8!r}, progress_bar=False)
        trainer.fit()
        trainer.close()
        print("loaded:" + {loaded})
    """
    code = """
        import json, sys
        import torch
        from torch import nn
        import kiln
    """ + fit.format(folder="ck", float8=False, loaded=LOADED)
    if with_float8:
        code += fit.format(folder="float8/ck", float8={"emulate": True}, loaded=LOADED)
    return code


def test_a_plain_run_imports_no_optional_package_and_float8_imports_torchao(tmp_path):
    with_float8 = importlib.util.find_spec("torchao") is not None
    loaded, _ = _run(_plain_runs(with_float8), tmp_path, marked=True)
    assert len(loaded) == (2 if with_float8 else 1), loaded
    assert loaded[0] == ["torch"]
    _needs("torchao")
    assert "torchao" in loaded[1]  # asked for: imported


# The Hugging Face run, then (torchao installed) torchao's warnings at use, in ONE interpreter: the
# run's transformers imports torchao (the import whose noise kiln keeps off), so what is logged after
# it is logged after torchao's import, as a user's would be; without transformers, torchao is
# imported here directly. One torch, kiln and torchao import instead of two.
HF_RUN = f"""
    import importlib.util, json, logging, sys
    import torch
    import kiln

    if importlib.util.find_spec("transformers") is not None:
        config = {{"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
                   "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}}
        model = kiln.models.HuggingFaceModel.from_config(config)
        tokens = torch.randint(0, 32, (2, 8))
        batches = [{{"input_ids": tokens, "labels": tokens}}] * 2
        trainer = kiln.Trainer(model, train_dataloader=batches, eval_dataloader=batches, max_duration="2ba",
                               optimizers=torch.optim.SGD(model.parameters(), lr=0.1), progress_bar=False)
        trainer.fit()
        trainer.eval()
    loaded = {LOADED}
    if importlib.util.find_spec("torchao") is not None:
        import torchao  # quiet: kiln keeps its import-time warnings off (imported already by transformers)
        logging.getLogger("torchao").warning("a warning at use")
        logging.getLogger("torchao").error("an error")
    print(loaded)
"""


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """What the one interpreter of HF_RUN loaded (before its own torchao import) and its stderr."""
    return _run(HF_RUN, tmp_path_factory.mktemp("hf_run"))


def test_a_hugging_face_run_prints_no_torchao_import_warnings(hf_run):
    _needs("transformers")
    loaded, err = hf_run
    assert "transformers" in loaded
    noise = [line for line in err.splitlines() if any(text in line for text in TORCHAO_IMPORT_NOISE)]
    assert not noise, "\n".join(noise)


def test_torchao_warnings_after_its_import_still_show(hf_run):
    _needs("torchao")
    _, err = hf_run
    assert "a warning at use" in err and "an error" in err
    assert not any(text in err for text in TORCHAO_IMPORT_NOISE), err
