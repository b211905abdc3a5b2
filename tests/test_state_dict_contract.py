"""``kiln.parallel.full_model_state_dict`` returns tensors only (issue 22): a HuggingFaceModel's
``_extra_state`` (its class and config as JSON) stays out unless ``extra_state=True`` asks for it,
so ``{k: v.cpu() for k, v in sd.items()}`` works under every strategy; checkpoints still keep the
config, so ``kiln checkpoint export --hf`` still finds it.

In this process: a plain HuggingFaceModel and the single-device Engine. On 2 ranks (one launch):
ddp, zero3, tensor parallel (the model's own plan) and a 2-stage pipeline, each through the Engine
and through its wrapped model.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

pytest.importorskip("transformers")

from distributed import WORKERS, check, fork_run  # noqa: E402

sys.path.insert(0, str(WORKERS))
import kiln  # noqa: E402
from hf_common import make_model  # noqa: E402
from kiln.parallel import full_model_state_dict  # noqa: E402

CASES = ["ddp", "zero3", "tp", "pp"]
# A pipeline's stage module (kiln.parallel.pipeline.PipelineModule) mirrors the wrapper's
# parameters and buffers but not its get_extra_state, so under pp there is no config to add.
NO_EXTRA_STATE = {"pp"}


def test_a_hugging_face_models_full_state_dict_holds_tensors_only():
    model = make_model(num_hidden_layers=2)
    assert "_extra_state" in model.state_dict()  # torch's own state_dict keeps the config entry
    state = full_model_state_dict(model)
    cpu = {k: v.cpu() for k, v in state.items()}  # failed on the JSON string before
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert set(cpu) == {k for k in model.state_dict() if k != "_extra_state"}
    with_extra = full_model_state_dict(model, extra_state=True)
    assert set(with_extra) - set(state) == {"_extra_state"}
    assert json.loads(with_extra["_extra_state"])["config"]["num_hidden_layers"] == 2


def test_the_engine_form_and_the_checkpoint_keep_what_they_kept():
    model = make_model(num_hidden_layers=2)
    engine = kiln.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = full_model_state_dict(engine)
    assert all(isinstance(v, torch.Tensor) for v in state.values()) and "_extra_state" not in state
    assert "_extra_state" in full_model_state_dict(engine, extra_state=True)
    # what a checkpoint saves (the strategy's state dict) still carries the config for exports
    saved = engine.strategy.state_dict(engine.model, engine.optimizer, full=True)["model"]
    assert json.loads(saved["_extra_state"])["class"] == "LlamaForCausalLM"


@pytest.fixture(scope="module")
def contract(tmp_path_factory):
    out = tmp_path_factory.mktemp("contract")
    check(fork_run(WORKERS / "state_dict_contract_worker.py", str(out), *CASES, nproc=2, timeout=300))
    return json.loads((out / "contract.json").read_text())


@pytest.mark.world_size(2)
@pytest.mark.parametrize("form", ["engine", "model"])
@pytest.mark.parametrize("case", CASES)
def test_every_strategy_gives_plain_tensors_and_the_config_on_request(contract, case, form):
    got = contract[f"{case}/{form}"]
    assert got["types"] == ["Tensor"], got["types"]  # no DTensor, no str
    assert got["keys"] == contract["reference_keys"]  # no module. prefix, every stage's layers
    if case in NO_EXTRA_STATE:
        assert got["extra_keys"] == []
    else:
        assert got["extra_keys"] == ["_extra_state"] and got["config_layers"] == 2
    assert got["max_diff"] == 0.0  # the same weights, gathered
