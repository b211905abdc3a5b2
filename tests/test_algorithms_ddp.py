"""Algorithms that leave parameters without gradients (StochasticDepth, LayerFreezing) under real
2-rank DDP: the Trainer turns on DDP's unused-parameter search, as Composer does, and the run equals
one process on the global batch. One launch of workers/unused_params_trainer.py runs every case on 2
ranks, and one the references on 1 process (a fresh model and Trainer per case)."""

from __future__ import annotations

import pytest
import torch

from distributed import WORKERS, check, fork_run

RUN = WORKERS / "unused_params_trainer.py"


ALGORITHMS, STRATEGIES = ("stochastic_depth", "layer_freezing"), ("ddp", "zero1")


def _launch(out, strategies, nproc):
    """One launch running every algorithm under each strategy in turn; {(algorithm, strategy): [rank results]}."""
    cases = [f"{algorithm}/{strategy}" for algorithm in ALGORITHMS for strategy in strategies]
    check(fork_run(RUN, str(out), *cases, nproc=nproc))
    return {
        (algorithm, strategy): [
            torch.load(out / f"{algorithm}_{strategy}_rank{r}.pt", weights_only=True) for r in range(nproc)
        ]
        for algorithm in ALGORITHMS
        for strategy in strategies
    }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    results = _launch(tmp_path_factory.mktemp("one_process"), ["single"], nproc=1)
    return {algorithm: results[algorithm, "single"][0] for algorithm in ALGORITHMS}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("two_ranks"), STRATEGIES, nproc=2)


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_two_ranks_equal_one_process(two_ranks, one_process, algorithm, strategy):
    # Without find_unused_parameters, StochasticDepth's skipped block stops DDP at the next step:
    # "Expected to have finished reduction in the prior iteration".
    ranks = two_ranks[algorithm, strategy]
    reference = one_process[algorithm]
    assert ranks[0]["batches"] == ranks[1]["batches"] == reference["batches"] == 16
    for name, value in reference["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        diff = (ranks[0]["weights"][name] - value).abs().max().item()
        assert diff < 1e-12, f"{algorithm}/{strategy}: {name} differs from one process by {diff:.3g}"


def test_the_flag_comes_from_the_algorithms():
    import kiln

    assert kiln.algorithms.StochasticDepth.find_unused_parameters
    assert kiln.algorithms.LayerFreezing.find_unused_parameters
    assert not kiln.algorithms.MixUp.find_unused_parameters
    trainer = kiln.Trainer(
        torch.nn.Linear(2, 2),
        criterion=torch.nn.CrossEntropyLoss(),
        algorithms=[kiln.algorithms.LayerFreezing()],
        strategy="ddp",
    )
    assert trainer.engine.strategy.find_unused_parameters  # one process: no DDP wrapper, the flag is kept
