"""The mixture-of-experts block (kiln.models.moe) on one process, against formulas written out here.

Every value is checked against an independent computation: a per-token loop over the chosen
experts for the layer's output and gradients, DeepSeek-V3's sequence-wise formula for the aux
loss, counts worked out by hand for capacity, bias updates and router statistics.

Checked by breaking the code on purpose: routing weights left out of the combine, or the bias
added to the weights as well as to the choice, fail test_matches_a_per_token_loop; the aux loss
averaged over tokens instead of sequences fails test_aux_loss_is_deepseeks_sequence_wise_formula;
counting the recomputation of a checkpointed forward fails test_router_stats_count_each_training_token_once.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.models.moe import MoE, aux_loss, router_stats, update_expert_bias

DIM, HIDDEN = 8, 12

CONFIGS = {
    "softmax": {},
    "softmax_norm_shared": {"route_norm": True, "num_shared_experts": 1},
    "sigmoid_deepseek": {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5, "load_balance": "bias"},
}


def _moe(num_experts=4, top_k=2, seed=0, **options):
    torch.manual_seed(seed)
    return MoE(DIM, HIDDEN, num_experts, top_k, **options).double()


def _per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's definition, one token at a time: its top-k experts by (score + bias), each
    expert's SwiGLU output times the token's (normalised, scaled) score, plus the shared experts."""
    router, experts = moe.router, moe.experts
    out = []
    for token in x.reshape(-1, DIM):
        logits = router.gate.weight @ token
        scores = logits.softmax(-1) if router.score_func == "softmax" else logits.sigmoid()
        bias = getattr(router, "expert_bias", torch.zeros_like(scores))
        chosen = sorted((scores + bias).topk(moe.top_k).indices.tolist())
        weights = scores[chosen]
        if router.route_norm:
            weights = weights / weights.sum()
        y = torch.zeros_like(token)
        for w, e in zip(weights * router.route_scale, chosen):
            y = y + w * ((F.silu(token @ experts.w1[e]) * (token @ experts.w3[e])) @ experts.w2[e])
        if moe.shared_experts is not None:
            y = y + moe.shared_experts(token)
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("config", CONFIGS)
def test_matches_a_per_token_loop(config):
    moe = _moe(**CONFIGS[config])
    if moe.load_balance == "bias":  # a bias that changes the choice of experts, and must not weigh them
        moe.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = torch.randn(3, 5, DIM, dtype=torch.float64, requires_grad=True)
    y = moe(x)
    x_ref = x.detach().clone().requires_grad_()
    ref = _per_token(moe, x_ref)
    assert torch.allclose(y, ref, atol=1e-13, rtol=0), (y - ref).abs().max()
    # and the gradients of the input and of every weight
    probe = torch.randn_like(y)
    grads = torch.autograd.grad((y * probe).sum(), [x, *moe.parameters()])
    ref_grads = torch.autograd.grad((ref * probe).sum(), [x_ref, *moe.parameters()])
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-13, rtol=0), (g - r).abs().max()


def test_bias_changes_the_choice_not_the_weights():
    moe = _moe(load_balance="bias")
    moe.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))
    tokens = torch.randn(6, DIM, dtype=torch.float64)
    weights, experts, scores = moe.router(tokens)
    assert (experts == 3).any(-1).all()  # every token goes to expert 3 ...
    chosen = scores.gather(-1, experts)
    assert torch.equal(weights, chosen) and (weights < 1).all()  # ... weighted by its score, not score + 100


def test_aux_loss_is_deepseeks_sequence_wise_formula():
    moe = _moe(aux_loss_coef=0.1)
    moe.train()
    x = torch.randn(3, 7, DIM, dtype=torch.float64)
    moe(x)
    tokens = x.reshape(-1, DIM)
    probs = (tokens @ moe.router.gate.weight.T).softmax(-1).reshape(3, 7, 4)
    picks = probs.topk(2, dim=-1).indices
    want = 0.0
    for b in range(3):  # per sequence: sum_i f_i P_i with f_i = E / (S k) * hits_i, then the mean
        hits = torch.bincount(picks[b].reshape(-1), minlength=4).double()
        f = hits * 4 / (7 * 2)
        want += (f * probs[b].mean(0)).sum().item() / 3
    assert aux_loss(moe).item() == pytest.approx(0.1 * want, rel=1e-13)
    # a mean over sequences: the halves of a batch average to the whole (data parallelism's premise)
    moe(x[:2])
    first = aux_loss(moe).item()
    moe(x[2:])
    assert (2 * first + aux_loss(moe).item()) / 3 == pytest.approx(0.1 * want, rel=1e-13)


def test_aux_loss_of_uniform_scores_is_its_coefficient():
    # P_i = 1/E for every expert, and sum_i f_i = E whatever the choice: the loss is exactly coef
    moe = _moe(aux_loss_coef=0.25)
    torch.nn.init.zeros_(moe.router.gate.weight)
    moe(torch.randn(2, 6, DIM, dtype=torch.float64))
    assert aux_loss(moe).item() == pytest.approx(0.25, rel=1e-15)
    moe.eval()
    moe.aux_loss = None
    moe(torch.randn(2, 6, DIM, dtype=torch.float64))
    assert aux_loss(moe) == 0.0  # evaluation computes none


def test_capacity_keeps_the_first_tokens_of_each_expert():
    moe = _moe(num_experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():  # every token prefers expert 0
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[0, 0] = 10.0
    x = torch.randn(16, DIM, dtype=torch.float64)
    x[:, 0] = x[:, 0].abs() + 1
    y = moe(x)
    capacity = math.ceil(0.5 * 16 * 1 / 2)  # 4 pairs per expert
    kept, dropped = y[:capacity], y[capacity:]
    assert (kept.abs().sum(-1) > 0).all() and torch.equal(dropped, torch.zeros_like(dropped))
    stats = router_stats(moe)
    assert stats["moe/tokens_per_expert/0"].item() == capacity
    assert stats["moe/tokens_per_expert/1"].item() == 0
    assert stats["moe/dropped_tokens"].item() == pytest.approx((16 - capacity) / 16)


def test_dropless_by_default_matches_any_large_capacity():
    x = torch.randn(4, 6, DIM, dtype=torch.float64)
    assert torch.equal(_moe()(x), _moe(capacity_factor=4.0)(x))  # 4x an even share: nothing dropped


def test_update_expert_bias_moves_towards_balance():
    moe = _moe(load_balance="bias", bias_update_rate=0.1)
    moe.tokens_per_expert.copy_(torch.tensor([5, 1, 3, 3]))
    update_expert_bias(moe)
    # mean 3: expert 0 got more (-0.1), expert 1 fewer (+0.1), 2 and 3 the mean (0); already centred
    assert torch.allclose(moe.router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0], dtype=torch.float64), atol=1e-15)
    assert moe.tokens_per_expert.sum().item() == 0  # the step's counts are cleared
    moe.tokens_per_expert.copy_(torch.tensor([4, 4, 4, 0]))
    update_expert_bias(moe)  # [-0.1, 0.1, 0, 0] + [-0.1, -0.1, -0.1, 0.1] = [-0.2, 0, -0.1, 0.1], minus its mean -0.05
    assert torch.allclose(
        moe.router.expert_bias, torch.tensor([-0.15, 0.05, -0.05, 0.15], dtype=torch.float64), atol=1e-15
    )


def test_a_bias_layer_warns_when_its_bias_is_never_updated(monkeypatch):
    import kiln.models.moe as moe_module

    monkeypatch.setattr(moe_module, "_STALE_BIAS_FORWARDS", 3)
    moe = _moe(load_balance="bias")
    x = torch.randn(2, 3, DIM, dtype=torch.float64)
    moe(x)
    moe(x)
    with pytest.warns(UserWarning, match=r"expert bias has not been updated in 3 training forwards.*MoEMonitor"):
        moe(x)
    update_expert_bias(moe)
    assert moe._forwards_since_update == 0


def test_router_stats_count_each_training_token_once():
    moe = _moe(num_experts=4, top_k=2)
    x = torch.randn(2, 5, DIM, dtype=torch.float64, requires_grad=True)
    _, experts, _ = moe.router(x.detach().reshape(-1, DIM))
    want = torch.bincount(experts.reshape(-1), minlength=4)
    # a forward under activation checkpointing: the backward recomputes it, which must not count
    out = torch.utils.checkpoint.checkpoint(moe, x, use_reentrant=False)
    out.sum().backward()
    moe.eval()
    moe(x)  # evaluation does not count either
    stats = router_stats(moe)
    assert [stats[f"moe/tokens_per_expert/{i}"].item() for i in range(4)] == want.tolist()
    assert stats["moe/imbalance"].item() == pytest.approx(want.max().item() / want.double().mean().item())
    assert "moe/dropped_tokens" not in stats
    assert router_stats(moe)["moe/tokens_per_expert/0"].item() == 0  # read once, then cleared


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_experts": 4, "top_k": 5}, "MoE top_k=5 must be an integer from 1 to num_experts=4"),
        ({"score_func": "relu"}, "MoE score_func='relu' must be one of softmax, sigmoid"),
        ({"load_balance": "aux"}, "MoE load_balance='aux' must be 'aux_loss', 'bias' (auxiliary-loss-free) or None"),
        ({"capacity_factor": 0}, "MoE capacity_factor=0 must be a positive number, or None for dropless routing"),
        ({"num_shared_experts": -1}, "MoE num_shared_experts=-1 must be an integer >= 0"),
    ],
)
def test_options_are_checked(options, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        MoE(DIM, HIDDEN, **options)


# -- the MoE Llama model -------------------------------------------------------------------------------
def test_moe_llama_builds_from_a_config_like_the_lm_examples():
    from kiln.config.args import load_trainer_args
    from kiln.config.trainer_builder import build_model

    config = {
        "model": {
            "type": "kiln.models.MoELlama",
            "args": {
                "vocab_size": 64,
                "dim": 32,
                "num_layers": 3,
                "num_heads": 4,
                "num_kv_heads": 2,
                "max_seq_len": 16,
                "num_experts": 4,
                "top_k": 2,
                "num_dense_layers": 1,
                "num_shared_experts": 1,
            },
        },
        "optimizer": {"type": "torch.optim.SGD", "args": {"lr": 0.1}},
        "dataset": {"type": "torch.utils.data.TensorDataset"},
        "max_train_steps": 1,
    }
    model = build_model(load_trainer_args(config, world_size=1))
    assert isinstance(model, kiln.models.MoELlama)
    kinds = [type(layer.feed_forward).__name__ for layer in model.layers]
    assert kinds == ["FeedForward", "MoE", "MoE"]
    experts = model.layers[1].feed_forward.experts
    assert tuple(experts.w1.shape) == (4, 32, 64) and tuple(experts.w2.shape) == (4, 64, 32)
    logits = model(torch.randint(0, 64, (2, 16)))
    assert tuple(logits.shape) == (2, 16, 64)


def test_moe_llama_rejects_unknown_fields():
    with pytest.raises(TypeError, match=r"MoELlama got unknown config fields \['num_expert'\]"):
        kiln.models.MoELlama(num_expert=4)


class _Patterns(torch.utils.data.Dataset):
    """Sequences that repeat a short random pattern: learnable in a few steps."""

    def __init__(self, n=32, seq=16, vocab=32):
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(0, vocab, (4,), generator=g).repeat(seq // 4) for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


class _Capture(kiln.loggers.LoggerDestination):
    def __init__(self):
        super().__init__()
        self.rows = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def test_moe_llama_trains_under_the_trainer_and_logs_router_stats():
    rows, _ = _moe_run(max_duration="8ba", callbacks=[kiln.callbacks.MoEMonitor(interval=4)])
    losses = [m["train/loss"] for _, m in rows if "train/loss" in m]
    assert losses[-1] < 0.8 * losses[0], losses
    logged = [(step, m) for step, m in rows if "moe/imbalance" in m]
    assert [step for step, _ in logged] == [4, 8]
    for _, m in logged:  # 4 batches x 8 sequences x 16 tokens x top_k 2 x 2 layers since the last log
        assert sum(m[f"moe/tokens_per_expert/{i}"] for i in range(4)) == 4 * 8 * 16 * 2 * 2
        assert m["moe/imbalance"] >= 1.0
        assert m["moe/imbalance"] == max(
            m["moe/imbalance/layers.0.feed_forward"], m["moe/imbalance/layers.1.feed_forward"]
        )


def _moe_run(max_duration="4ba", **options):
    """A MoELlama trained under the Trainer: the rows its loggers got, and its MoEMonitors."""
    torch.manual_seed(0)
    model = kiln.models.MoELlama(
        vocab_size=32, dim=32, num_layers=2, num_heads=4, max_seq_len=16, num_experts=4, top_k=2
    )
    capture = _Capture()
    trainer = kiln.Trainer(
        model,
        train_dataloader=torch.utils.data.DataLoader(_Patterns(), batch_size=8),
        max_duration=max_duration,
        optimizers=torch.optim.AdamW(model.parameters(), lr=1e-2),
        loggers=[capture],
        progress_bar=False,
        seed=0,
        **options,
    )
    trainer.fit()
    monitors = [c for c in trainer.state.callbacks if isinstance(c, kiln.callbacks.MoEMonitor)]
    return capture.rows, monitors


def _logged_at(run):
    rows, monitors = run
    return [step for step, m in rows if "moe/imbalance" in m], monitors


def test_a_model_with_moe_layers_gets_the_router_statistics_by_default():
    # every log_interval (2 batches here), with no callback given: the run file's MoE runs log them too
    steps, monitors = _logged_at(_moe_run(log_interval="2ba"))
    assert steps == [2, 4] and [m.interval for m in monitors] == [2]
    # one the user gave is the only one; moe_monitor=False turns the default off
    steps, monitors = _logged_at(_moe_run(callbacks=[kiln.callbacks.MoEMonitor(interval=4)]))
    assert steps == [4] and [m.interval for m in monitors] == [4]
    assert _logged_at(_moe_run(moe_monitor=False)) == ([], [])
