"""Context parallelism with torch's ring attention on CUDA (make gpu-check runs every ``gpu`` test).

One launch (workers/cp_gpu_worker.py) with a rank per GPU: a tiny dense MoELlama in float32
against one process on whole sequences with plain attention. On one GPU the cp mesh is a ring of
one, which still runs torch's CP dispatch and attention kernels on kiln's prepared batch (position
ids, shift labels, torch's split, the loss reduction); with 2 GPUs or more, also 2 SGD steps under
``Hybrid(cp=N)`` through the Engine. Tolerance: float32 attention kernels against the math one.
"""

from __future__ import annotations

import json

import pytest
import torch

from distributed import WORKERS, check, kiln_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
TOL = 2e-4


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_gpu")
    check(kiln_run(WORKERS / "cp_gpu_worker.py", str(out), nproc=torch.cuda.device_count(), timeout=300))
    return json.loads((out / "cp_gpu.json").read_text())


def test_ring_attention_step_equals_one_process(result):
    assert result["direct"]["loss_abs"] < TOL, result
    assert result["direct"]["grad_abs"] < TOL, result


def test_hybrid_cp_trains_as_one_process(result):
    if result["world_size"] < 2:
        pytest.skip("Hybrid(cp=N) needs 2 GPUs or more; the ring of one ran above")
    hybrid = result["hybrid"]
    assert hybrid["loss_abs"] < TOL and hybrid["grad_abs"] < TOL and hybrid["weight_abs"] < TOL, hybrid
