# The Colossal-AI walk-through's config.py (step 1), sized for the digits data set.
from kiln import AMP_TYPE

BATCH_SIZE = 32
NUM_EPOCHS = 8
LEARNING_RATE = 0.05

fp16 = dict(
    mode=AMP_TYPE.TORCH,
)
