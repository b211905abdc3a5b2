"""compile= and activation_checkpointing=: what they apply, that they change no name and no loss.

One process: the tiny transformer of workers/levers_model.py under the single-device strategy, the
Trainer's, Engine's and YAML's options and their errors, and a compiled checkpoint resumed eagerly
and back. Two ranks (one launch of workers/levers_worker.py): every strategy of
levers_model.STRATEGIES (ddp, zero3, tp, pp; zero1 is ddp's model) with each checkpointing mode
(float64: the losses of none, exactly) and with compile (float32: within 1e-5). Inductor compiles
in each process itself (compile_threads=1): its default pool of compile workers would start fresh
interpreters that import torch, in every process that compiles.
"""

from __future__ import annotations

import copy
import json
import sys
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import kiln
from distributed import WORKERS, check, fork_run
from kiln.checkpoint.offline import load_full
from kiln.config.args import TrainerArgs
from kiln.config.overrides import ConfigError
from kiln.parallel import SingleDevice
from kiln.parallel.transforms.levers import SAVED_OPS, applied_levers
from kiln.parallel.transforms.parallelize import ParallelizeOptions

sys.path.insert(0, str(WORKERS))  # the tiny transformer lives beside the workers
from levers_model import STRATEGIES, lm_loss, make_data, make_model  # noqa: E402

LAYERS = [f"layers.{i}" for i in range(4)]
AC = ["activation_checkpointing"]


@pytest.fixture(autouse=True)
def _inductor_compiles_in_this_process():
    # by default (2 CPUs here) inductor's first compile starts a pool of compile workers, fresh
    # interpreters that import torch: more CPU than the few kernels of these tests take to build
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        yield


def _is_layer(module):
    return type(module).__name__ == "Layer"


def _engine(dtype=torch.float64, **levers):
    model = make_model(dtype)
    engine = kiln.Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), lm_loss, strategy="single", **levers)
    return model, engine


def _train(engine, steps=3, batch=8):
    x, y = make_data(steps, batch)
    losses = []
    for step in range(steps):
        engine.zero_grad()
        loss = engine.criterion(engine(x[step * batch : (step + 1) * batch]), y[step * batch : (step + 1) * batch])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _levers(model):
    return {name: applied_levers(model.get_submodule(name)) for name in LAYERS}


# -- activation checkpointing -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "mode, checkpointed",
    [
        ("full", LAYERS),
        ("selective", LAYERS),
        ("selective:op", LAYERS),
        ("selective:2", ["layers.1", "layers.3"]),
        ("selective:3", ["layers.2"]),
        (_is_layer, LAYERS),
        # any module, not only blocks: each Linear with 32 outputs (every fc1, and the head)
        (lambda m: isinstance(m, nn.Linear) and m.out_features == 32, [*(f"{b}.fc1" for b in LAYERS), "head"]),
    ],
    ids=["full", "selective", "selective:op", "selective:2", "selective:3", "callable", "callable-any-module"],
)
def test_checkpointing_gives_the_losses_of_none_exactly_in_float64(mode, checkpointed):
    plain, engine = _engine()
    reference = _train(engine)
    model, engine = _engine(activation_checkpointing=mode)
    assert _train(engine) == reference
    assert [n for n, m in model.named_modules() if applied_levers(m)] == checkpointed
    assert all(applied_levers(model.get_submodule(n)) == AC for n in checkpointed)
    assert list(model.state_dict()) == list(plain.state_dict())
    for name, value in model.state_dict().items():  # the same weights after training, bit for bit
        assert torch.equal(value, plain.state_dict()[name]), name


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "mode, gelu, attention",
    [(None, 0, 0), ("full", 4, 4), ("selective", 4, 0), ("selective:2", 2, 2)],
)
def test_the_backward_recomputes_what_the_mode_says(mode, gelu, attention):
    # forward ops seen during the backward are recomputations: "full" redoes the whole block,
    # "selective" everything but the matmuls and attention it saved, "selective:2" every other block
    model, engine = _engine(activation_checkpointing=mode)
    x, y = make_data(1, 8)
    loss = engine.criterion(engine(x), y)
    counter = _CountOps()
    with counter:
        loss.backward()
    sdpa = sum(n for op, n in counter.counts.items() if op.startswith("_scaled_dot_product") and "backward" not in op)
    assert (counter.counts["gelu"], sdpa) == (gelu, attention)
    if mode == "selective":
        assert counter.counts["addmm"] == 0  # fc1/fc2's outputs were kept
        assert torch.ops.aten.addmm.default in SAVED_OPS


def test_checkpointing_is_skipped_without_grad_and_evaluates_the_same():
    plain, _ = _engine()
    model, engine = _engine(activation_checkpointing="full")
    x, _ = make_data(1, 8)
    counter = _CountOps()
    with torch.no_grad(), counter:
        out = model(x)
    assert torch.equal(out, plain(x).detach())
    assert counter.counts["gelu"] == 4  # one forward, nothing run twice


def test_a_choice_that_checkpoints_nothing_is_an_error():
    with pytest.raises(ValueError, match=r"^activation_checkpointing='full' found no blocks in Linear .*callable"):
        kiln.Engine(nn.Linear(2, 2), None, nn.MSELoss(), strategy="single", activation_checkpointing="full")
    with pytest.raises(ValueError, match=r"^activation_checkpointing=<function .* accepted no module of TinyLM"):
        _engine(activation_checkpointing=lambda m: False)


# -- compile ----------------------------------------------------------------------------------------
def test_compile_float32_is_within_1e_5_of_eager():
    _, engine = _engine(torch.float32)
    eager = _train(engine)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, engine = _engine(torch.float32, compile=True, activation_checkpointing="selective")
    compiled = _train(engine)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # inductor ran, not eager
    assert _levers(model) == {name: ["compile", *AC] for name in LAYERS}
    assert max(abs(a - b) for a, b in zip(compiled, eager)) <= 1e-5, (compiled, eager)


def test_compile_settings_reach_torch_compile_per_block():
    graphs = []

    def backend(gm, example_inputs):  # a torch.compile backend that runs the captured graph eagerly
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    _, engine = _engine()
    reference = _train(engine)
    model, engine = _engine(compile={"backend": backend, "fullgraph": True})
    assert _train(engine) == reference  # the graph dynamo captured, run eagerly: float64-exact
    assert graphs and all("layers" not in str(node.target) for gm in graphs for node in gm.graph.nodes)
    assert _levers(model) == {name: ["compile"] for name in LAYERS}
    assert applied_levers(model) == []  # the blocks, not the root


def test_a_model_without_blocks_is_compiled_whole():
    model = nn.Linear(3, 2).double()
    kiln.Engine(model, None, nn.MSELoss(), strategy="single", compile={"backend": "eager"})
    assert applied_levers(model) == ["compile"] and list(model.state_dict()) == ["weight", "bias"]


# -- names --------------------------------------------------------------------------------------------
def test_the_levers_keep_every_name_and_apply_once():
    plain = make_model()
    model, engine = _engine(compile={"backend": "eager"}, activation_checkpointing="full")
    for names in (lambda m: list(m.state_dict()), lambda m: [n for n, _ in m.named_parameters()]):
        assert names(model) == names(plain)
    assert [n for n, _ in model.named_modules()] == [n for n, _ in plain.named_modules()]
    assert not any("_orig_mod" in k or "_checkpoint_wrapped_module" in k for k in model.state_dict())
    # a second Engine on the same model adds nothing (a Trainer built twice)
    kiln.Engine(model, None, lm_loss, strategy="single", compile=True, activation_checkpointing="full")
    assert _levers(model) == {name: ["compile", *AC] for name in LAYERS}


def test_a_deep_copy_runs_its_own_weights():
    model, _ = _engine(compile={"backend": "eager"}, activation_checkpointing="full")
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x, _ = make_data(1, 4)
    assert applied_levers(twin.layers[0]) == ["compile", *AC]
    assert twin.layers[0].forward.__self__ is twin.layers[0]
    assert not torch.equal(twin(x), model(x))


# -- the options: Trainer, Engine, initialize, YAML ---------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compile": "yes"}, r"^compile='yes' must be True, a dict of settings, or None/False \(off\)$"),
        ({"compile": {"mdoe": "max-autotune"}}, r"^compile=\{'mdoe': 'max-autotune'\} has 'mdoe', which torch.compile"),
        ({"activation_checkpointing": "ful"}, r"^activation_checkpointing='ful' must be 'full', 'selective'"),
        ({"activation_checkpointing": "selective:0"}, r"^activation_checkpointing='selective:0' must be"),
        ({"activation_checkpointing": 2}, r"^activation_checkpointing=2 must be"),
    ],
)
def test_bad_values_are_one_line_naming_the_option(kwargs, message):
    model = make_model()
    for build in (
        lambda: kiln.Trainer(model, criterion=lm_loss, **kwargs),
        lambda: kiln.Engine(model, None, lm_loss, **kwargs),
    ):
        with pytest.raises(ValueError, match=message) as info:
            build()
        assert "\n" not in str(info.value)
        assert applied_levers(model.layers[0]) == []  # refused before the strategy touched the model


def test_the_trainer_hands_the_options_to_the_strategy():
    model = make_model()
    trainer = kiln.Trainer(model, criterion=lm_loss, compile={"backend": "eager"}, activation_checkpointing="full")
    assert trainer.options.levers.compile == {"backend": "eager"}
    options = trainer.engine.strategy.parallelize_options
    assert (options.compile, options.activation_checkpointing) == ({"backend": "eager"}, "full")
    assert _levers(model) == {name: ["compile", *AC] for name in LAYERS}
    with pytest.raises(
        ValueError, match=r"^compile=True / activation_checkpointing=None / float8=None are given with engine="
    ):
        kiln.Trainer(engine=trainer.engine, compile=True)


def test_the_engine_keeps_a_strategy_s_own_options_it_does_not_override():
    strategy = SingleDevice()
    strategy.parallelize_options = ParallelizeOptions(activation_checkpointing="selective")
    model = make_model()
    kiln.Engine(model, None, lm_loss, strategy=strategy, compile={"backend": "eager"})
    assert strategy.parallelize_options == ParallelizeOptions(
        compile={"backend": "eager"}, activation_checkpointing="selective"
    )
    assert _levers(model) == {name: ["compile", *AC] for name in LAYERS}


def test_initialize_reads_them_from_the_config():
    model = make_model()
    config = {"strategy": "single", "compile": {"backend": "eager"}, "activation_checkpointing": "selective:2"}
    engine, *_ = kiln.initialize(model, torch.optim.AdamW(model.parameters()), lm_loss, config=config)
    assert _levers(model) == {
        "layers.0": ["compile"],
        "layers.1": ["compile", *AC],
        "layers.2": ["compile"],
        "layers.3": ["compile", *AC],
    }
    assert engine.strategy.parallelize_options.activation_checkpointing == "selective:2"


_ARGS = {
    "model": {"type": "examples.mlp_model.MLP"},
    "optimizer": {"type": "torch.optim.AdamW"},
    "dataset": {"type": "examples.mlp_model.RandomDataset"},
    "max_epochs": 1,
}


def test_yaml_keys_map_onto_the_trainer_options():
    from kiln.config.trainer_builder import _activation_checkpointing

    args = TrainerArgs.from_dict({**_ARGS, "compile": {"mode": "max-autotune"}, "activation_checkpointing": "full"})
    assert (args.compile, args.activation_checkpointing) == ({"mode": "max-autotune"}, "full")
    assert TrainerArgs.from_dict(_ARGS).compile is False
    assert _activation_checkpointing("selective:2") == "selective:2"
    assert _activation_checkpointing("levers_model.lm_loss") is lm_loss  # a name: the function it names


@pytest.mark.parametrize(
    "values, message",
    [
        ({"compile": "yes"}, r"^compile: got 'yes' \(str\), expected true or false or dict"),
        ({"compile": {"mdoe": 1}}, r"^compile: compile=\{'mdoe': 1\} has 'mdoe', which torch.compile does not take"),
        (
            {"activation_checkpointing": "ful"},
            r"^activation_checkpointing: got 'ful' \(str\), expected full, selective",
        ),
    ],
)
def test_yaml_bad_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        TrainerArgs.from_dict({**_ARGS, **values})


# -- checkpoints: compiled <-> eager ------------------------------------------------------------------
def _trainer(folder, duration, *, load_path=None, save_type="sharded", **levers):
    tokens, targets = make_data(4, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, targets), batch_size=8)
    model = make_model()
    return kiln.Trainer(
        model,
        train_dataloader=loader,
        max_duration=duration,
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        criterion=lm_loss,
        strategy="single",
        save_folder=str(folder),
        save_interval="2ba",
        save_type=save_type,
        load_path=load_path,
        progress_bar=False,
        **levers,
    )


def _keys(state, prefix=""):
    """The dotted paths of every leaf of a nested state dict."""
    if not isinstance(state, dict):
        return [prefix]
    return sorted(k for key, value in state.items() for k in _keys(value, f"{prefix}{key}."))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The final weights of the eager run the resumed ones must equal (the same for both save types)."""
    trainer = _trainer(tmp_path_factory.mktemp("uninterrupted"), "4ba")
    trainer.fit()
    return trainer.engine.module.state_dict()


@pytest.mark.parametrize("save_type", ["sharded", "merged"])
def test_a_compiled_checkpoint_resumes_eagerly_and_back_bit_exact(tmp_path, save_type, uninterrupted):
    # aot_eager: dynamo and AOTAutograd as with inductor, the graph run by eager kernels, so float64
    # training is bit-exact with eager and any difference is the checkpoint's
    compiled = {"compile": {"backend": "aot_eager"}}
    expected = uninterrupted
    for first, then, name in ((compiled, {}, "compiled_then_eager"), ({}, compiled, "eager_then_compiled")):
        half = _trainer(tmp_path / name, "2ba", save_type=save_type, **first)
        half.fit()
        assert applied_levers(half.engine.module.layers[0]) == (["compile"] if first else [])
        resumed = _trainer(tmp_path / f"{name}_resumed", "4ba", load_path=str(tmp_path / name / "last"), **then)
        assert resumed.state.timestamp.batch.value == 2
        assert applied_levers(resumed.engine.module.layers[0]) == (["compile"] if then else [])
        resumed.fit()
        for key, value in resumed.engine.module.state_dict().items():
            assert torch.equal(value, expected[key]), (name, key)
    # the checkpoint written under compile holds what the eager one does, key for key
    _, saved_compiled, _ = load_full(tmp_path / "compiled_then_eager" / "last")
    _, saved_eager, _ = load_full(tmp_path / "eager_then_compiled" / "last")
    assert list(saved_compiled["model"]) == list(expected)
    assert _keys(saved_compiled) == _keys(saved_eager) and any(".exp_avg_sq" in k for k in _keys(saved_eager))


def test_an_inductor_checkpoint_has_the_plain_keys_and_loads_into_a_plain_model(tmp_path):
    trainer = _trainer(tmp_path, "2ba", save_type="merged", compile=True, activation_checkpointing="full")
    trainer.fit()
    saved = load_full(tmp_path / "last")[1]["model"]
    plain = make_model()
    assert list(saved) == list(plain.state_dict())
    plain.load_state_dict(saved)  # strict: no key missing, none unexpected
    for key, value in trainer.engine.module.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)


# -- two ranks: every strategy ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    # the first test to use it pays for this launch: 259 s measured on a loaded machine, hence the
    # tests' timeout(900) beside kiln_run's 600
    out = tmp_path_factory.mktemp("levers")
    check(fork_run(WORKERS / "levers_worker.py", str(out), nproc=2, timeout=600))
    return json.loads((out / "levers.json").read_text())


def _expected_levers(name, rank, levers, on=LAYERS):
    """{block: levers if it is in ``on`` else []} for the blocks the rank holds."""
    held = LAYERS if name != "pp" else LAYERS[2 * rank : 2 * rank + 2]  # pp: this rank's stage
    return {block: list(levers) if block in on else [] for block in held}


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_two_ranks_checkpointing_gives_the_losses_of_none_exactly(two_ranks, name):
    for rank, results in enumerate(two_ranks):
        r = results[name]
        for case in ("full", "selective", "selective:2", "callable"):
            assert r[case] == r["none64"], (name, rank, case)
        assert r["full_levers"] == r["callable_levers"] == _expected_levers(name, rank, AC)
        every_other = _expected_levers(name, rank, AC, on=("layers.1", "layers.3"))
        assert r["selective:2_levers"] == every_other, (name, rank)


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_two_ranks_compile_is_within_1e_5_and_keeps_the_keys(two_ranks, name):
    for rank, results in enumerate(two_ranks):
        r = results[name]
        assert r["graphs"] >= 1, (name, rank)
        for case in ("compile", "compile_full"):
            gap = max(abs(a - b) for a, b in zip(r[case], r["eager32"]))
            assert gap <= 1e-5, (name, rank, case, r[case], r["eager32"])
        assert r["compile_levers"] == _expected_levers(name, rank, ["compile"])
        # tensor parallel compiles beneath a whole-block checkpoint (a torch bug; see levers.compile_module)
        both = [*AC, "compile"] if name == "tp" else ["compile", *AC]
        assert r["both_levers"] == _expected_levers(name, rank, both), (name, rank)
        assert r["eager_keys"] == r["compile_keys"] == r["both_keys"], (name, rank)
        assert "layers.1.fc1.weight" in r["eager_keys"]["model"] or name == "pp"


@pytest.mark.timeout(900)
@pytest.mark.world_size(2)
def test_two_ranks_dcp_checkpoints_load_across_compile(two_ranks):
    for results in two_ranks:
        assert results["zero3"]["compiled_to_eager"] is True
        assert results["tp"]["eager_to_compiled"] is True
