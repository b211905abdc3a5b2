# The Colossal-AI walk-through's config.py, unchanged in form: module-level names are the config.
from kiln import AMP_TYPE

BATCH_SIZE = 32
NUM_EPOCHS = 4
LEARNING_RATE = 0.1

fp16 = dict(mode=AMP_TYPE.TORCH)  # torch autocast + GradScaler: kiln's "amp_fp16"
clip_grad_norm = 1.0
gradient_accumulation = 1
