"""Save checkpoints in a loop until killed, for crash-safety tests: ``ckpt_crash.py FOLDER [async]``.

Prints ``saved N`` after each committed checkpoint, so the test knows saving has begun before it
sends SIGKILL at a random moment. Retention (keep 2) runs too, so deletes are interrupted as well.
"""

import sys

import torch

import kiln
from kiln.checkpoint import CheckpointSaver
from workers.ckpt_common import build_state

folder, save_async = sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "async"
saver = CheckpointSaver(folder, interval="1ba", num_checkpoints_to_keep=2, save_async=save_async)
state = build_state(callbacks=[saver], width=512)  # a few MB per checkpoint: saving takes a while
saver.run_event(kiln.Event.FIT_START, state, None)
x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
while True:
    state.engine.zero_grad()
    state.engine.backward(state.engine.criterion(state.engine(x), y))
    state.engine.optimizer_step()
    state.timestamp.advance_batch(8)
    saver.run_event(kiln.Event.BATCH_CHECKPOINT, state, None)
    print(f"saved {state.timestamp.batch.value}", flush=True)
