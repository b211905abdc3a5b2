"""A tiny transformer language model for the compile / activation-checkpointing tests.

Pre-norm blocks (attention through ``scaled_dot_product_attention``, then an MLP) in an
``nn.ModuleList`` named ``layers``, so :func:`kiln.parallel.transforms.parallelize.find_blocks` finds them
(``layers.0`` ...) and the same blocks are what FSDP shards, checkpointing recomputes and compile
compiles. ``TP_PLAN`` splits attention by heads and the MLP by hidden units (Megatron style).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kiln.parallel import Pipeline, TensorParallel

VOCAB, DIM, HEADS, SEQ = 32, 16, 2, 8
TP_PLAN = {
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.fc1": "colwise",
    "layers.*.fc2": "rowwise",
}
# The strategies the 2-rank worker runs (a fresh object per run). Not zero1: it is ddp's model
# (kiln.parallel.zero.Zero1 subclasses DDP and changes only the optimizer), and the levers apply to
# the model; ddp's case checks its names and its optimizer state's keys.
STRATEGIES = {
    "ddp": lambda: "ddp",
    "zero3": lambda: "zero3",
    "tp": lambda: TensorParallel(TP_PLAN),
    "pp": lambda: Pipeline(["layers.2"], schedule="1f1b", microbatches=2),
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds HEADS / tp of them
        q, k, v = (proj(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(DIM), Attention()
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(num_layers))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM().to(dtype)


def make_data(steps: int = 3, global_batch: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their next tokens: ``steps`` batches of ``global_batch`` sequences."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (steps * global_batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
