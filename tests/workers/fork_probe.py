"""A rank for tests/test_fork_run.py: says who it is, then does what argv[1] says.

``ok``: reads a DataLoader through a worker process (started as a fresh rank's are: by fork,
not by re-running this script), exits 0. ``fail``: rank 1 raises after rank 0 has entered a barrier (rank 0 then waits for
a peer that never comes: the job must stop it). ``exit3``: rank 1 exits with status 3."""

import os
import sys

import torch
import torch.distributed as dist

import kiln

ctx = kiln.launch_from_torch()
fresh = os.environ.get("KILN_FORK_PROBE")  # set by the test for this job only
line = f"rank {ctx.rank} of {ctx.world_size} cwd={os.getcwd()} probe={fresh} threads={torch.get_num_threads()}"
mode = sys.argv[1]
if mode == "ok":
    loader = torch.utils.data.DataLoader(range(6), batch_size=2, num_workers=1)
    line += f" loader={sum(int(batch.sum()) for batch in loader)}"
line += "\n"
os.write(1, line.encode())
if mode == "fail" and ctx.rank == 1:
    raise RuntimeError("planned failure on rank 1")
if mode == "exit3" and ctx.rank == 1:
    sys.exit(3)
if mode == "fail":
    dist.barrier()
os.write(2, f"rank {ctx.rank} done\n".encode())
