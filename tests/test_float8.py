"""FP8 through torchao: which linears convert, the refusal where FP8 cannot run, and an emulated step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.parallel.transforms.float8 import (
    Float8Settings,
    check_float8_device,
    convert_float8,
    float8_eligible,
    float8_settings,
)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24)  # 24 is not a multiple of 16: stays
        self.down = nn.Linear(24, 16)  # 24 in: stays
        self.lm_head = nn.Linear(16, 32)  # skipped by name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.down(torch.relu(self.odd(torch.relu(self.up(x))))))


def test_settings_and_their_errors():
    assert float8_settings(None) is None and float8_settings(False) is None
    assert float8_settings(True) == Float8Settings()
    assert float8_settings({"recipe": "rowwise", "skip": ["head"]}) == Float8Settings("rowwise", False, ("head",))
    with pytest.raises(ValueError, match=r"^float8 recipe='delayed': expected one of tensorwise, rowwise$"):
        float8_settings({"recipe": "delayed"})
    with pytest.raises(ValueError, match=r"^float8 has unknown keys \['scale'\]"):
        float8_settings({"scale": 1})
    with pytest.raises(ValueError, match=r"^float8='yes': expected True"):
        float8_settings("yes")
    with pytest.raises(ValueError, match=r"^float8 skip='lm_head': expected a list"):
        float8_settings({"skip": "lm_head"})


def test_refused_on_cpu_and_on_a_gpu_without_fp8(monkeypatch):
    with pytest.raises(ValueError, match=r"^float8 training needs an NVIDIA GPU .* this run is on cpu\. Use"):
        check_float8_device(torch.device("cpu"), Float8Settings())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"^float8 training needs compute capability 8\.9 .*A100-SXM4-80GB has 8\.0"):
        check_float8_device(torch.device("cuda", 0), Float8Settings())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device(torch.device("cuda", 0), Float8Settings())  # an H100: accepted
    check_float8_device(torch.device("cpu"), Float8Settings(emulate=True))  # emulation runs anywhere
    # the refusal comes before any layer changes
    model = Tiny()
    with pytest.raises(ValueError, match="this run is on cpu"):
        convert_float8(model, True, torch.device("cpu"))
    assert type(model.up) is nn.Linear


def test_eligibility_rules():
    settings = Float8Settings()
    model = Tiny()
    assert float8_eligible(model.up, "up", settings)
    assert not float8_eligible(model.odd, "odd", settings) and not float8_eligible(model.down, "down", settings)
    assert not float8_eligible(model.lm_head, "lm_head", settings)
    assert not float8_eligible(model.lm_head, "model.lm_head", settings)
    assert float8_eligible(model.lm_head, "lm_head_2", settings)  # a whole name, not a prefix


def test_emulated_conversion_keeps_names_and_trains_close_to_full_precision():
    torchao_float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model, reference = Tiny(), Tiny()
    reference.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    convert_float8(model, {"emulate": True}, torch.device("cpu"))
    assert isinstance(model.up, torchao_float8.float8_linear.Float8Linear)
    assert all(type(layer) is nn.Linear for layer in (model.odd, model.down, model.lm_head))
    assert list(model.state_dict()) == keys  # checkpoints are the same with and without FP8
    x = torch.randn(8, 32)
    out, expected = model(x), reference(x)
    out.square().mean().backward()
    expected.square().mean().backward()
    # e4m3 has a 3-bit mantissa: the first layer's output moves by a few percent, not more
    assert (out - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.isfinite(model.up.weight.grad).all() and model.up.weight.grad.abs().sum() > 0
    # e5m2 gradients (2-bit mantissa): the direction within a few degrees, the size within 10%
    grad, expected_grad = model.up.weight.grad.flatten(), reference.up.weight.grad.flatten()
    assert nn.functional.cosine_similarity(grad, expected_grad, dim=0) > 0.97
    assert abs(grad.norm() / expected_grad.norm() - 1) < 0.1


def test_the_trainer_refuses_float8_on_the_cpu_and_trains_emulated():
    pytest.importorskip("torchao.float8")
    import kiln

    data = torch.utils.data.TensorDataset(torch.randn(32, 32), torch.randn(32, 32))
    loader = torch.utils.data.DataLoader(data, batch_size=8)

    def trainer(float8):
        torch.manual_seed(0)
        model = Tiny()
        return kiln.Trainer(
            model,
            train_dataloader=loader,
            max_duration="4ba",
            criterion=nn.MSELoss(),
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            progress_bar=False,
            float8=float8,
        )

    with pytest.raises(ValueError, match=r"^float8 training needs an NVIDIA GPU .* this run is on cpu"):
        trainer(True)
    with pytest.raises(ValueError, match=r"^float8 recipe='fast'"):
        trainer({"recipe": "fast"})
    fp8, plain = trainer({"emulate": True}), trainer(None)
    assert type(fp8.state.model.up).__name__ == "Float8Linear" and type(plain.state.model.up) is nn.Linear
    fp8.fit()
    plain.fit()
    assert abs(float(fp8.state.loss) - float(plain.state.loss)) < 0.05 * float(plain.state.loss)
