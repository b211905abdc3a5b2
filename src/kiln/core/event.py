"""Events: the named points of the training loop where algorithms, callbacks and loggers run."""

from __future__ import annotations

from enum import Enum

__all__ = ["Event"]


class Event(str, Enum):
    """Points in the training loop, fired inline by :class:`kiln.Trainer`.

    The loop, with each event where it fires::

        INIT                                  # Trainer.__init__, after state is built
        BEFORE_LOAD / AFTER_LOAD              # around loading `load_path` (in __init__)
        FIT_START
        while not done:
            EPOCH_START
            for batch in dataloader:          # each fetch is wrapped in
                BEFORE_DATALOADER             #   BEFORE_DATALOADER
                batch = next(it)
                AFTER_DATALOADER              #   AFTER_DATALOADER
                BATCH_START
                BEFORE_TRAIN_BATCH
                for microbatch in split(batch, grad_accum):
                    BEFORE_FORWARD
                    outputs = model(microbatch)
                    AFTER_FORWARD
                    BEFORE_LOSS
                    loss = model.loss(outputs, microbatch)
                    AFTER_LOSS
                    BEFORE_BACKWARD
                    loss.backward()
                    AFTER_BACKWARD
                AFTER_TRAIN_BATCH             # gradients are complete (still scaled under fp16)
                unscale and clip              # once, by the Engine (clip_grad_norm)
                BEFORE_OPTIMIZER_STEP         # the final gradients: unscaled and clipped
                optimizer.step()              # per-batch schedulers step after it
                timestamp += batch            # the batch is counted before BATCH_END
                BATCH_END
                if eval is due: <eval loop>   # before the checkpoint, which records its metrics
                BATCH_CHECKPOINT              # CheckpointSaver saves here on batch intervals
            EPOCH_END
            if eval is due: <eval loop>
            EPOCH_CHECKPOINT                  # CheckpointSaver saves here on epoch intervals
        FIT_END

        <eval loop>:
            EVAL_START
            for batch in eval_dataloader:
                EVAL_BATCH_START
                EVAL_BEFORE_FORWARD
                outputs = model.eval_forward(batch)
                EVAL_AFTER_FORWARD
                metrics.update(outputs, batch)
                EVAL_BATCH_END
            EVAL_END

    Algorithms run before callbacks on every event and loggers run last. On ``AFTER_*`` events
    (and ``*_END``) algorithms run in reverse order, so that an algorithm that wraps a step
    undoes its change in the opposite order, as in Composer.
    """

    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    BEFORE_OPTIMIZER_STEP = "before_optimizer_step"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    FIT_END = "fit_end"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"

    # Enum's own __hash__ is Python code; the loop looks events up in dicts and sets many times
    # per batch, so hash them as the strings they are (consistent with str equality).
    __hash__ = str.__hash__

    @property
    def is_after_event(self) -> bool:
        """Whether algorithms run in reverse order on this event."""
        return self.value.startswith(("after_", "eval_after_")) or self.value.endswith("_end")
