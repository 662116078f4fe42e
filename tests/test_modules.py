"""FusedLinear: nn.Linear-compatible parameters and state_dict, activations, training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cutlass_ext
from cutlass_ext.ops import _activation

from .helpers import assert_close_to_reference, fp32_precision


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_matches_nn_linear(device, bias):
    fused = cutlass_ext.FusedLinear(24, 40, bias=bias, device=device)
    plain = nn.Linear(24, 40, bias=bias, device=device)
    assert fused.state_dict().keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        assert fused.state_dict()[key].shape == value.shape
    fused.load_state_dict(plain.state_dict())
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(5, 24, device=device)
    with fp32_precision("fp32"):
        assert_close_to_reference(fused(x), torch.relu(plain(x)).double(), None, "fp32")


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid"])
def test_from_linear_shares_parameters(device, activation):
    plain = nn.Linear(32, 16, device=device, dtype=torch.bfloat16)
    fused = cutlass_ext.FusedLinear.from_linear(plain, activation=activation)
    assert fused.weight is plain.weight and fused.bias is plain.bias
    x = torch.randn(3, 7, 32, device=device, dtype=torch.bfloat16)
    ref = _activation.apply(torch.nn.functional.linear(x.double(), plain.weight.double(), plain.bias.double()),
                            activation or "none")
    peer = _activation.apply(plain(x), activation or "none")
    assert_close_to_reference(fused(x), ref, peer, "bf16")
    assert f"activation={activation or 'none'!r}" in repr(fused)


def test_from_linear_rejects_other_modules():
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        cutlass_ext.FusedLinear.from_linear(nn.Conv1d(3, 3, 1))


def test_bad_activation_is_rejected():
    with pytest.raises(ValueError, match="activation must be one of"):
        cutlass_ext.FusedLinear(4, 4, activation="tanh")


def test_initialisation_matches_nn_linear_bounds():
    fused = cutlass_ext.FusedLinear(256, 64)
    bound = 1 / 256**0.5
    assert fused.weight.abs().max() <= bound and fused.bias.abs().max() <= bound
    assert fused.weight.std() > bound / 3  # not zeros


def test_training_reduces_loss(device):
    torch.manual_seed(0)
    model = nn.Sequential(
        cutlass_ext.FusedLinear(16, 64, activation="gelu", device=device),
        cutlass_ext.FusedLinear(64, 1, activation=None, device=device),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(256, 16, device=device)
    y = x[:, :1] * 2 - x[:, 1:2]
    losses = []
    with fp32_precision("fp32"):
        for _ in range(60):
            opt.zero_grad()
            loss = (model(x) - y).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
