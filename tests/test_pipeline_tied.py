"""Tied embeddings under a pipeline (kiln.parallel.pipelining.tied_weights): a tiny Llama with
``tie_word_embeddings=True`` cut into stages trains as one process does.

torch's split copies the tied weight into the first stage (the embedding) and the last (the head);
kiln sums the copies' gradients after each step's last backward (Megatron's embedding group), keeps
one tensor per stage for the optimizer, and counts the weight once in the clipped norm. Two
launches (workers/pipeline_tied_worker.py): 2 ranks run a 2-stage 1F1B pipeline (the copies on two
ranks, summed over a group of the pair) and ZBV (both copies on rank 0, summed there); 4 ranks run
2 stages with FSDP inside each (the copies' gradients are dp_shard-sharded DTensors). Each case:
2 SGD steps (the second on the first's summed copies) of 2 accumulated backwards, clipped every step,
against the one-process run. Checked by breaking it on purpose: the copies' gradients summed in
the first step only fail pp (the second step's norm 1.48 against 2.03, the copies off by 2.7e-2).
"""

import json

import pytest
import torch
from torch import nn

from distributed import WORKERS, check, fork_run

TOL = 1e-9


def _launch(tmp_path_factory, nproc: int, *cases: str) -> dict:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp(f"tied{nproc}")
    check(fork_run(WORKERS / "pipeline_tied_worker.py", str(out), *cases, nproc=nproc, timeout=300))
    return json.loads((out / "pipeline_tied.json").read_text())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 2, "pp", "pp_zbv")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return _launch(tmp_path_factory, 4, "pp_fsdp")


@pytest.mark.parametrize("case", ["pp", "pp_zbv", "pp_fsdp"])
def test_tied_embeddings_train_as_in_one_process(request, case):
    run = request.getfixturevalue("four_ranks" if case == "pp_fsdp" else "two_ranks")[case]
    losses = max(abs(a - b) for a, b in zip(run["losses"], run["ref_losses"], strict=True))
    assert losses < TOL, f"{case}: losses {run['losses']} vs one process {run['ref_losses']}"
    # the norm before clipping counts the tied weight once (both copies hold its whole gradient)
    norms = max(abs(a - b) for a, b in zip(run["norms"], run["ref_norms"], strict=True))
    assert norms < TOL, f"{case}: gradient norms {run['norms']} vs one process {run['ref_norms']}"
    # both copies (the first stage's embedding, the last stage's head) are the one-process weight
    for name, diffs in run["copies"].items():
        assert diffs, f"{case}: no rank holds {name}"
        assert max(diffs) < TOL, f"{case}: {name} differs from the one-process tied weight by {max(diffs)}"


def test_the_norm_leaves_out_the_uncounted_copies():
    from kiln.parallel.state.grad_norm import clip_grad_norm_

    first, copy, other = (nn.Parameter(torch.zeros(2, dtype=torch.float64)) for _ in range(3))
    first.grad, copy.grad, other.grad = (torch.tensor([3.0, 0.0], dtype=torch.float64) for _ in range(3))
    norm = clip_grad_norm_([first, copy, other], max_norm=1.0, uncounted=[copy])
    assert norm.item() == pytest.approx(18**0.5)  # 3 and 3, not 3, 3 and 3
    assert torch.equal(copy.grad, first.grad)  # the copy is clipped with the others


def test_the_optimizer_takes_every_copy_under_any_of_a_tied_weights_names():
    from kiln.parallel.state.optimizer_params import parameter_names, repoint_optimizer

    model = nn.ModuleDict({"embed": nn.Embedding(4, 2), "head": nn.Linear(2, 4, bias=False)})
    model["head"].weight = model["embed"].weight
    names = parameter_names(model)
    assert names[id(model["embed"].weight)] == ("embed.weight", "head.weight")
    last, both = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(4, 2))
    for stage, want in (({"head.weight": last}, [last]), ({"embed.weight": both, "head.weight": last}, [both, last])):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        repoint_optimizer(opt, names, stage, strategy="pp", drop_missing=True)
        assert opt.param_groups[0]["params"] == want


def test_copies_laid_out_differently_are_refused_in_one_line():
    from kiln.parallel.pipelining.tied_weights import TiedWeights, _Tied

    # a V-shaped schedule's rank holds both copies: checked here, without a group
    copies = [nn.Parameter(torch.zeros(4, 2, dtype=dtype)) for dtype in (torch.float32, torch.float64)]
    labels = ["embed.weight on stage 0", "head.weight on stage 3"]
    tied = TiedWeights([_Tied(("embed.weight", "head.weight"), copies, labels, None, counted=True)])
    with pytest.raises(ValueError) as error:
        tied._check_layouts()
    assert str(error.value).startswith(
        "tied weight embed.weight = head.weight: its copies on the pipeline's stages are laid out differently "
        "(embed.weight on stage 0: float32 [4, 2] whole (a plain tensor); head.weight on stage 3: float64 [4, 2] "
        "whole (a plain tensor)), so their gradients cannot be summed;"
    )
    assert str(error.value).endswith("or untie them (tie_word_embeddings=False)")


def test_copies_on_one_rank_sum_their_gradients_there():
    from kiln.parallel.pipelining.tied_weights import TiedWeights, _Tied

    first, last = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    first.grad, last.grad = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0, 30.0])
    tied = TiedWeights([_Tied(("e", "h"), [first, last], ["e on stage 0", "h on stage 3"], None, counted=True)])
    tied.sum_grads()
    assert first.grad.tolist() == last.grad.tolist() == [11.0, 22.0, 33.0]
    assert tied.uncounted == [last]
