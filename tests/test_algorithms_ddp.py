"""Algorithms that leave parameters without gradients (StochasticDepth, LayerFreezing) under real
2-rank DDP: the Trainer turns on DDP's unused-parameter search, as Composer does, and the run equals
one process on the global batch."""

from __future__ import annotations

import pytest
import torch

from distributed import WORKERS, check, kiln_run

RUN = WORKERS / "unused_params_trainer.py"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    outs = {}
    for algorithm in ("stochastic_depth", "layer_freezing"):
        out = tmp_path_factory.mktemp(algorithm)
        check(kiln_run(RUN, str(out), algorithm, "single", nproc=1))
        outs[algorithm] = torch.load(out / "rank0.pt", weights_only=True)
    return outs


@pytest.mark.world_size(2)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
@pytest.mark.parametrize("algorithm", ["stochastic_depth", "layer_freezing"])
def test_two_ranks_equal_one_process(tmp_path, one_process, algorithm, strategy):
    # Without find_unused_parameters, StochasticDepth's skipped block stops DDP at the next step:
    # "Expected to have finished reduction in the prior iteration".
    check(kiln_run(RUN, str(tmp_path), algorithm, strategy))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
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
