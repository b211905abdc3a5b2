"""Background saves stage into host buffers that are reused between saves (kiln.checkpoint.staging):
the pool's rules on CPU tensors, a Trainer's async saves, and pinned buffers for CUDA tensors."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch
from torch import nn

import kiln
from kiln.checkpoint.staging import StagingBuffers, staging_buffers_for

CUDA = torch.cuda.is_available()


def _state_dict(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "a.weight": torch.randn(4, 3, generator=g).to(device),
            "b.weight": torch.randn(4, 3, generator=g).to(device),  # the same shape and dtype as a.weight
            "t": torch.randn(5, 2, generator=g).to(device).t(),  # strides (1, 2)
            "half": torch.randn(6, generator=g).to(device, torch.bfloat16),
        },
        "optimizer": {
            "state": {"a.weight": {"step": torch.tensor(3.0).to(device), "exp_avg": torch.randn(4, 3, generator=g)}},
            "param_groups": [{"lr": 0.1, "params": ["a.weight"], "betas": (0.9, 0.99)}],
        },
    }


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else []
    return [t for value in values for t in _tensors(value)]


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def test_staged_copy_is_a_snapshot_in_buffers_the_next_save_reuses():
    source = _state_dict()
    buffers = StagingBuffers(pin_memory=False)
    staged = buffers.stage(source)
    # The same tree and values; the tensors are new memory with the source's strides
    assert staged["optimizer"]["param_groups"] == source["optimizer"]["param_groups"]
    pairs = list(zip(_tensors(source), _tensors(staged)))
    assert len(pairs) == 6 and buffers.num_allocated == 6
    for original, copy in pairs:
        assert torch.equal(original, copy) and copy.dtype == original.dtype and copy.stride() == original.stride()
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr() and not copy.is_pinned()
    for tensor in _tensors(source):
        tensor.add_(1)  # training goes on: the staged copy does not move
    assert all(not torch.equal(original, copy) for original, copy in pairs)
    first = {t.data_ptr() for t in _tensors(staged)}
    # Until the write is done its buffers are not handed out again
    assert buffers.num_free() == 0
    buffers.release_when_done(_done())
    assert buffers.num_free() == 6
    again = buffers.stage(source)
    assert buffers.num_allocated == 6 and {t.data_ptr() for t in _tensors(again)} == first
    assert all(torch.equal(a, b) for a, b in zip(_tensors(source), _tensors(again)))
    assert buffers.num_free() == 0


def test_buffers_of_a_write_in_flight_are_not_reused_and_a_failed_write_returns_them():
    source = _state_dict()
    buffers = StagingBuffers(pin_memory=False)
    first = buffers.stage(source)
    writing: Future = Future()
    buffers.release_when_done(writing)
    second = buffers.stage(source)  # while the first is still being written
    assert buffers.num_allocated == 12
    assert not {t.data_ptr() for t in _tensors(first)} & {t.data_ptr() for t in _tensors(second)}
    writing.set_exception(OSError("disk full"))  # a failed write is done with its buffers too
    assert buffers.num_free() == 6
    buffers.stage(source)
    assert buffers.num_allocated == 12
    # A tensor whose shape changed gets a new buffer; the pool then holds only the last save's
    buffers.release_when_done(_done())
    source["model"]["a.weight"] = torch.zeros(8, 3)
    buffers.stage(source)
    assert buffers.num_allocated == 13
    buffers.release_when_done(_done())
    assert buffers.num_free() == 6


def test_dtensor_shards_stage_under_their_spec():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # the conftest destroys it
    mesh = init_device_mesh("cpu", (2,))
    shard = DTensor.from_local(torch.randn(3, 4), mesh, [Shard(0)])
    buffers = StagingBuffers(pin_memory=False)
    staged = buffers.stage({"w": shard})["w"]
    assert isinstance(staged, DTensor) and staged.placements == shard.placements and staged.shape == (6, 4)
    assert torch.equal(staged.to_local(), shard.to_local())
    assert staged.to_local().data_ptr() != shard.to_local().data_ptr()
    buffers.release_when_done(_done())
    again = buffers.stage({"w": shard})["w"]
    assert again.to_local().data_ptr() == staged.to_local().data_ptr() and buffers.num_allocated == 1


def _trainer(tmp_path, device: str | None = None) -> tuple[kiln.Trainer, list[dict[str, torch.Tensor]]]:
    """3 steps, an async save after each; the weights after each step, as the checkpoint should hold them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
    weights: list[dict[str, torch.Tensor]] = []

    class Weights(kiln.Callback):
        def batch_end(self, state, logger):
            weights.append({k: v.detach().cpu().clone() for k, v in state.model.state_dict().items()})

    trainer = kiln.Trainer(
        model,
        train_dataloader=data,
        max_duration="3ba",
        optimizers=torch.optim.Adam(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        device=device,
        save_folder=tmp_path,
        save_interval="1ba",
        save_async=True,
        callbacks=[Weights()],
        progress_bar=False,
    )
    return trainer, weights


def test_a_trainers_async_saves_reuse_one_set_of_buffers(tmp_path):
    from kiln.cli.main import main

    trainer, weights = _trainer(tmp_path)
    trainer.fit()
    trainer.close()
    # One allocation per tensor of a save (4 weights, Adam's 2 moments each and its step counts),
    # at the first save; the second and third reuse them
    pool = staging_buffers_for(trainer.state.engine.model)
    assert pool.num_allocated == 4 * 4 and pool.num_free() == 16
    assert not any(buffer.is_pinned() for buffer in pool.free_buffers())  # CPU tensors: plain memory
    # Each checkpoint holds the weights of its own step, not a later save's
    for step in (1, 2, 3):
        out = tmp_path / f"merged-{step}.pt"
        assert main(["checkpoint", "merge", str(tmp_path / f"ep0-ba{step}"), str(out)]) == 0
        saved = torch.load(out, weights_only=True)["model"]
        assert saved.keys() == weights[step - 1].keys()
        assert all(torch.equal(saved[k], weights[step - 1][k]) for k in saved), step


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_tensors_stage_into_pinned_buffers_reused_between_saves(tmp_path):
    source = _state_dict("cuda")
    buffers = StagingBuffers()
    staged = buffers.stage(source)
    cuda = [(s, c) for s, c in zip(_tensors(source), _tensors(staged)) if s.is_cuda]
    assert len(cuda) == 5  # exp_avg was made on the CPU: it stays unpinned
    assert all(c.device.type == "cpu" and c.is_pinned() and torch.equal(s.cpu(), c) for s, c in cuda)
    assert not staged["optimizer"]["state"]["a.weight"]["exp_avg"].is_pinned()
    for s, _ in cuda:
        s.add_(1)  # queued on the stream after the copies: the staged values do not move
    assert all(not torch.equal(s.cpu(), c) for s, c in cuda)
    buffers.release_when_done(_done())
    again = buffers.stage(source)
    assert buffers.num_allocated == 6
    assert {t.data_ptr() for t in _tensors(again)} == {t.data_ptr() for t in _tensors(staged)}
    # and a Trainer's async saves on the GPU go through them
    trainer, weights = _trainer(tmp_path, device="cuda")
    trainer.fit()
    trainer.close()
    pool = staging_buffers_for(trainer.state.engine.model)
    assert pool.num_allocated == 16 and pool.num_free() == 16
    # pinned: the buffers of the weights and Adam's moments; Adam keeps its step counts on the host
    # (unless fused or capturable), and those buffers are plain
    on_gpu = 4 + sum(t.is_cuda for t in _tensors(trainer.state.optimizers[0].state_dict()["state"]))
    assert on_gpu >= 12 and sum(buffer.is_pinned() for buffer in pool.free_buffers()) == on_gpu
