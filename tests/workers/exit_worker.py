"""A job of 2 or more ranks that trains a few DDP steps and ends, for the clean-exit tests.

Usage: exit_worker.py [FAIL_RANK | destroy | mixed]. The script returns right after its last backward, the
moment at which torch 2.13's gloo threads can still be waiting for the GIL (see kiln/launch/teardown.py).
With FAIL_RANK, that rank raises after one all-reduce instead, without DDP: the launcher's report of
the failure is what that job shows, not the exit race, and building DDP imports torch._dynamo (~3
CPU-s a rank). With ``destroy`` the script ends with its own ``destroy_process_group()``, as many
scripts do. ``mixed``: odd ranks end with their own ``destroy_process_group()``; even ranks leave the
group to kiln and print ``rank R: group destroyed at exit`` when kiln's exit handler destroys it
(while Python is still alive, after ``finished``).
"""

import os
import sys

import torch

import kiln

ctx = kiln.launch_from_torch()
fail_rank = int(sys.argv[1]) if sys.argv[1:2] and sys.argv[1].isdigit() else None
if fail_rank is None:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
else:
    torch.distributed.all_reduce(torch.ones(1))  # the group is in use when that rank fails
if sys.argv[1:] == ["destroy"] or (sys.argv[1:] == ["mixed"] and ctx.rank % 2):
    torch.distributed.destroy_process_group()
elif sys.argv[1:] == ["mixed"]:
    # kiln.launch.teardown calls torch.distributed.destroy_process_group at exit: say when it does
    destroy = torch.distributed.destroy_process_group

    def announced(*args, **kwargs):
        os.write(1, f"rank {ctx.rank}: group destroyed at exit\n".encode())
        return destroy(*args, **kwargs)

    torch.distributed.destroy_process_group = announced
elif ctx.rank == fail_rank:
    raise RuntimeError(f"planned failure on rank {ctx.rank}")
# one write per line: with PYTHONUNBUFFERED, print writes the text and the newline apart, and the
# ranks' lines, sharing one pipe, glue ("rank 0 finishedrank 1 finished")
os.write(1, f"rank {ctx.rank} finished\n".encode())
