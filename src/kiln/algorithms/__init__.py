"""Training-efficiency algorithms (Composer's library), each a :class:`kiln.Algorithm` on the events.

===========================  ===========================================  ================================
algorithm                    what it changes                              events
===========================  ===========================================  ================================
``SelectiveBackprop``        drops low-loss samples from the batch        BEFORE_TRAIN_BATCH
``ProgressiveResizing``      shrinks images early in training             BEFORE_TRAIN_BATCH
``SeqLengthWarmup``          shortens sequences early in training         BEFORE_TRAIN_BATCH
``ChannelsLast``             NHWC memory format for weights and inputs    INIT, BEFORE_FORWARD
``StochasticDepth``          skips residual blocks in training            INIT, BATCH_START
``LowPrecisionLayerNorm``    LayerNorm in bf16/fp16 under autocast        INIT
``MixUp`` / ``CutMix``       mixes inputs; mixes targets or the loss      BEFORE_FORWARD, BEFORE_LOSS or
                                                                          AFTER_LOSS, AFTER_BACKWARD
``LabelSmoothing``           smooths the targets the loss sees            BEFORE_LOSS, AFTER_BACKWARD
``SAM``                      gradient at a nearby worst point             AFTER_TRAIN_BATCH
``GradientClipping``         clips by norm, value or unit (AGC)           BEFORE_OPTIMIZER_STEP
``LayerFreezing``            freezes early layers progressively           FIT_START, BATCH_END
``EMA``                      evaluates an average of the weights          BATCH_END, EVAL_START/END
``SWA``                      averages weights late in training            BATCH_START/END, EPOCH_END
===========================  ===========================================  ================================

Order. Algorithms run in the order given on each event, and in reverse order on ``AFTER_*`` and
``*_END`` events, before callbacks. Each algorithm acts on its own events so that most
combinations give the same result in any order:

- batch-level changes (``SelectiveBackprop``, ``ProgressiveResizing``, ``SeqLengthWarmup``) act on
  the whole batch before it is split into microbatches, so they come before any per-microbatch one;
  SelectiveBackprop placed first scores the unresized batch, placed after ProgressiveResizing the
  resized one;
- MixUp/CutMix mix inputs at ``BEFORE_FORWARD``; target changes (MixUp, CutMix, LabelSmoothing)
  happen at ``BEFORE_LOSS`` in list order and are undone at ``AFTER_BACKWARD`` in reverse order,
  so the dataset's targets are back for metrics; since mixing and smoothing are linear their order
  does not change the loss;
- a loss-interpolating MixUp/CutMix recomputes the loss at ``AFTER_LOSS`` with the targets the
  loss saw (smoothed if LabelSmoothing runs), whatever the list order.

Rules enforced by :func:`check_algorithm_compatibility` (the Trainer calls it): at most one
loss-interpolating algorithm; each kiln algorithm at most once; not EMA with SWA; not SAM with a
loss-interpolating algorithm; ``GradientClipping`` listed before ``SAM``.

Randomness comes from a ``torch.Generator`` per algorithm, whose state is in the algorithm's
``state_dict`` with everything else a resume needs, so a resumed run is bit-exact.

Example::

    from kiln.algorithms import EMA, LabelSmoothing, MixUp
    trainer = kiln.Trainer(model, train_dataloader=dl, max_duration="20ep", criterion=nn.CrossEntropyLoss(),
                           algorithms=[MixUp(alpha=0.2), LabelSmoothing(0.1), EMA(half_life="50ba")])
"""

from kiln.algorithms.channels_last import ChannelsLast
from kiln.algorithms.compatibility import check_algorithm_compatibility
from kiln.algorithms.cutmix import CutMix
from kiln.algorithms.ema import EMA
from kiln.algorithms.gradient_clipping import GradientClipping
from kiln.algorithms.label_smoothing import LabelSmoothing
from kiln.algorithms.layer_freezing import LayerFreezing
from kiln.algorithms.low_precision_layernorm import LowPrecisionLayerNorm
from kiln.algorithms.mixup import MixUp
from kiln.algorithms.progressive_resizing import ProgressiveResizing
from kiln.algorithms.sam import SAM
from kiln.algorithms.selective_backprop import SelectiveBackprop
from kiln.algorithms.seq_length_warmup import SeqLengthWarmup
from kiln.algorithms.stochastic_depth import StochasticDepth
from kiln.algorithms.swa import SWA

__all__ = [
    "ChannelsLast",
    "CutMix",
    "EMA",
    "GradientClipping",
    "LabelSmoothing",
    "LayerFreezing",
    "LowPrecisionLayerNorm",
    "MixUp",
    "ProgressiveResizing",
    "SAM",
    "SWA",
    "SelectiveBackprop",
    "SeqLengthWarmup",
    "StochasticDepth",
    "check_algorithm_compatibility",
]
