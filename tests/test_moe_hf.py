"""Hugging Face mixture-of-experts models train under the Trainer as a plain loop trains them.

transformers' MixtralForCausalLM and Qwen3MoeForCausalLM, tiny and in float64, built from a config
with ``output_router_logits`` so that their loss carries the load-balancing loss, wrapped in
kiln.models.HuggingFaceModel: 3 SGD steps under the Trainer give the losses (and weights) of a
plain torch loop on the same batches within 1e-12.

``experts_implementation="eager"``: transformers 5 runs the experts with torch._grouped_mm by
default, which refuses float64 on a CPU (float32 runs either way).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import kiln  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 3, 4, 12, 64
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.05,
    "experts_implementation": "eager",
}


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**COMMON, num_local_experts=4))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, num_experts=4, moe_intermediate_size=16, head_dim=4))


class _Capture(kiln.loggers.LoggerDestination):
    def __init__(self):
        super().__init__()
        self.losses = []

    def log_metrics(self, metrics, step=None):
        if "train/loss" in metrics:
            self.losses.append(metrics["train/loss"])


def _batches():
    # the same batch every step: its loss must fall
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).repeat(STEPS, 1)
    return [{"input_ids": ids[i], "labels": ids[i]} for i in range(len(ids))]


@pytest.mark.parametrize("build", [_mixtral, _qwen3_moe], ids=["mixtral", "qwen3_moe"])
def test_hf_moe_trains_under_the_trainer_like_a_plain_loop(build):
    torch.manual_seed(0)
    hf = build().double()
    reference = copy.deepcopy(hf)
    data = _batches()

    # the plain loop: model(**batch).loss, which includes router_aux_loss_coef * aux_loss
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    want = []
    for step in range(STEPS):
        batch = {k: torch.stack([d[k] for d in data[step * BATCH : (step + 1) * BATCH]]) for k in data[0]}
        opt.zero_grad()
        out = reference(**batch, use_cache=False)
        assert out.aux_loss is not None and out.aux_loss.item() > 0  # the balancing loss is in the loss
        out.loss.backward()
        opt.step()
        want.append(out.loss.item())

    model = kiln.models.HuggingFaceModel(hf)
    capture = _Capture()
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(data, batch_size=BATCH),
        max_duration=f"{STEPS}ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.5),
        loggers=[capture],
        progress_bar=False,
    )
    trainer.fit()
    assert capture.losses == pytest.approx(want, rel=1e-12, abs=0)
    assert want[-1] < want[0]
    for (name, p), q in zip(hf.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-12), name
