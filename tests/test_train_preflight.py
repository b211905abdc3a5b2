"""``kiln train --nproc-per-node N`` makes the dry run's checks of the plan in the launching process,
before any worker starts: one line, exit status 2, the message ``kiln plan --dry-run`` gives.

In process: the relaunch (``kiln run``'s workers) is replaced by a recorder, so a test sees whether
the command got that far without starting processes.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from distributed import ROOT
from kiln.cli.main import main

pytest.importorskip("transformers")

RUN = str(ROOT / "examples" / "moe_pretrain.yaml")
# 6 experts over ep=4: the mesh fits the world (ep divides dp_shard = 4), the experts do not split
BAD_EP = ["--compute_config.ep", "4", "--model.args.num_experts", "6"]


@pytest.fixture
def relaunches(monkeypatch):
    import kiln.cli.train

    calls: list[int] = []
    monkeypatch.setattr(kiln.cli.train, "_relaunch", lambda args, nproc: calls.append(nproc) or 0)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # lm_data, as kiln train's cwd would give
    return calls


def test_an_ep_that_does_not_divide_the_experts_stops_before_any_worker(relaunches, capsys):
    assert main(["train", "-f", RUN, "--nproc-per-node", "4", *BAD_EP]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert relaunches == []
    assert err == [
        "kiln train: error: ep=4 does not divide num_experts=6 of MoE layer 'layers.1.feed_forward' (each rank "
        "holds num_experts / ep whole experts); use an ep in [1, 2, 3, 6]"
    ]
    # the dry run's own words for the same run
    assert main(["plan", "--dry-run", "-f", RUN, "--world-size", "4", *BAD_EP]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [err[0].replace("kiln train", "kiln plan", 1)]


def test_a_plan_that_fits_is_launched_and_leaves_no_fake_world(relaunches, capsys):
    import kiln

    assert main(["train", "-f", RUN, "--nproc-per-node", "4"]) == 0
    assert relaunches == [4]
    assert capsys.readouterr().err == ""
    assert not dist.is_initialized() and kiln.context().world_size == 1
