"""A Trainer job as a SLURM batch script runs it: checkpoints, autoresume, and a signal ahead of the
time limit (tests/test_slurm.py).

    slurm_requeue.py OUT [--signal-after N] [--signal-launcher]

Each batch appends its loss to OUT/steps.jsonl; the end appends the final weights. With
``--signal-after N`` the process sends itself SIGUSR1 at the end of batch N (what
``#SBATCH --signal=USR1@120`` delivers before the time limit): the Trainer checkpoints at the end
of the batch, requeues the job through ``scontrol`` and exits 75. ``--signal-launcher``: the signal
goes to the parent instead, the ``kiln run`` that ``srun`` started, which passes it on (the batch
waits for it to arrive).
"""

import argparse
import json
import os
import signal
import time

import torch
from torch import nn

import kiln

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--signal-after", type=int, default=None)
parser.add_argument("--signal-launcher", action="store_true")
opts = parser.parse_args()

g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
log = os.open(os.path.join(opts.out, "steps.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def line(**fields):
    os.write(log, (json.dumps(fields) + "\n").encode())


class Signal(kiln.Callback):
    def batch_end(self, state, logger):
        batch = state.timestamp.batch.value
        line(batch=batch, loss=state.loss.item())
        if batch == opts.signal_after and opts.signal_launcher:
            passed_on(signal.SIGUSR1)
        elif batch == opts.signal_after:
            os.kill(os.getpid(), signal.SIGUSR1)


def passed_on(signum):
    """Signal the launcher and wait here until it has passed the signal on to this process, so the
    checkpoint is taken at this batch (the launcher's handler runs within its 0.1 s monitor loop)."""
    arrived = []
    previous = signal.getsignal(signum)  # the Trainer's preemption handler

    def note(received, frame):
        arrived.append(received)
        previous(received, frame)

    signal.signal(signum, note)
    os.kill(os.getppid(), signum)
    deadline = time.monotonic() + 60
    while not arrived and time.monotonic() < deadline:
        time.sleep(0.01)
    signal.signal(signum, previous)


trainer = kiln.Trainer(
    model,
    train_dataloader=torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
    max_duration="2ep",
    optimizers=torch.optim.AdamW(model.parameters(), lr=0.01),
    criterion=nn.CrossEntropyLoss(),
    callbacks=[Signal()],
    save_folder=os.path.join(opts.out, "ckpt"),
    save_interval="1ep",
    autoresume=True,
    seed=3,
    progress_bar=False,
)
line(event="start", batch=trainer.state.timestamp.batch.value)
trainer.fit()
line(event="end", weights={k: v.tolist() for k, v in trainer.state.model.state_dict().items()})
os.close(log)
