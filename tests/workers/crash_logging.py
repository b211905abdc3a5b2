"""A 2-rank Trainer with a FileLogger (its defaults) that dies at a known batch, for the crash-durability tests.

    crash_logging.py OUT HOW AT [--save] [--autoresume]

``HOW`` says how the job ends at batch ``AT``:

- ``peer-sigkill``: rank 1 SIGKILLs itself at ``BATCH_END`` of batch AT (rank 0, the logging
  rank, then fails in the next collective and the launcher stops it);
- ``raise``: rank 0's forward of batch AT raises;
- ``sigterm``: rank 0 gets SIGTERM at ``BATCH_END`` of batch AT (as from ``kill`` or a launcher);
- ``self-sigkill``: rank 0 waits ``2 * flush_secs`` at ``BATCH_END`` of batch AT, then SIGKILLs
  itself: only the time-based flush can have written the earlier steps;
- ``none``: trains its 40 batches.

``BATCH_END`` comes before the step's ``train/loss`` is logged, so steps 1 .. AT-1 are the ones
logged before the end. ``--save`` adds a save folder, ``OUT/ckpt``, saved every 2 batches (and
SIGTERM is then kiln's preemption: checkpoint, then exit 75); ``--autoresume`` resumes from it.
"""

import os
import signal
import sys
import time

import torch
from torch import nn

import kiln
from kiln.loggers import FileLogger

out, how, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
save, autoresume = "--save" in sys.argv[4:], "--autoresume" in sys.argv[4:]
ctx = kiln.launch_from_torch()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if how == "raise" and ctx.rank == 0 and self.calls == at:
            raise RuntimeError(f"planned failure in forward of batch {at} on rank 0")
        return self.linear(x)


class Die(kiln.Callback):
    def batch_end(self, state, logger):
        if state.timestamp.batch.value != at:
            return
        if how == "peer-sigkill" and ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "sigterm" and ctx.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        elif how == "self-sigkill" and ctx.rank == 0:
            time.sleep(2 * file_logger.flush_secs)
            os.kill(os.getpid(), signal.SIGKILL)


kiln.seed_everything(0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(400, 8, generator=g), torch.randint(0, 4, (400,), generator=g))
model = Net()
file_logger = FileLogger(f"{out}/metrics.jsonl")
trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(data, batch_size=4),
    max_duration="40ba",
    optimizers=torch.optim.SGD(model.parameters(), lr=0.01),
    criterion=nn.CrossEntropyLoss(),
    strategy="ddp",
    callbacks=[Die()],
    loggers=[file_logger],
    save_folder=f"{out}/ckpt" if save else None,
    save_interval="2ba",
    autoresume=autoresume,
    progress_bar=False,
)
trainer.fit()
