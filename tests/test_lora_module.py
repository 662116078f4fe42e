"""FusedLoRALinear: initialisation, frozen base, state_dict keys, from_linear / from_peft, merge and
unmerge, rsLoRA scaling, dropout in training only, training, and errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cutlass_ext
from cutlass_ext.ops import _activation

from .helpers import assert_close_to_reference, fp32_precision


def lora_ref(layer, x):
    """The layer's formula in float64 (no dropout)."""
    z = F.linear(x.double(), layer.weight.double(), layer.bias.double() if layer.bias is not None else None)
    z = z + layer.scaling * F.linear(F.linear(x.double(), layer.lora_A.weight.double()), layer.lora_B.weight.double())
    return _activation.apply(z, layer.activation)


def test_init_like_peft_and_nn_linear(device):
    layer = cutlass_ext.FusedLoRALinear(256, 64, r=16, device=device)
    bound = 1 / math.sqrt(256)  # kaiming_uniform(a=sqrt(5)) over fan_in 256, as nn.Linear and PEFT's lora_A
    assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
    assert layer.lora_A.weight.shape == (16, 256) and layer.lora_B.weight.shape == (64, 16)
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 3
    assert torch.count_nonzero(layer.lora_B.weight) == 0
    x = torch.randn(3, 5, 256, device=device)
    with fp32_precision("fp32"):
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))  # B = 0: the base alone


def test_dtype_and_device_follow_factory(device):
    layer = cutlass_ext.FusedLoRALinear(32, 16, r=4, device=device, dtype=torch.bfloat16)
    for name, p in layer.named_parameters():
        assert p.dtype == torch.bfloat16 and p.device.type == device, name


def test_base_is_frozen_and_only_the_adapter_trains(device):
    layer = cutlass_ext.FusedLoRALinear(24, 40, r=4, device=device)
    nn.init.normal_(layer.lora_B.weight)
    trainable = {name for name, p in layer.named_parameters() if p.requires_grad}
    assert trainable == {"lora_A.weight", "lora_B.weight"}
    x = torch.randn(7, 24, device=device, requires_grad=True)
    layer(x).square().sum().backward()
    assert layer.weight.grad is None and layer.bias.grad is None
    assert layer.lora_A.weight.grad is not None and layer.lora_B.weight.grad is not None and x.grad is not None


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_keys(device, bias):
    layer = cutlass_ext.FusedLoRALinear(24, 40, r=8, bias=bias, device=device)
    expected = {"weight": (40, 24), "lora_A.weight": (8, 24), "lora_B.weight": (40, 8)}
    if bias:
        expected["bias"] = (40,)
    sd = layer.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == expected
    # nn.Linear checkpoints load into the base; the adapter keys are the only extra ones
    plain = nn.Linear(24, 40, bias=bias, device=device)
    missing, unexpected = layer.load_state_dict(plain.state_dict(), strict=False)
    assert set(missing) == {"lora_A.weight", "lora_B.weight"} and not unexpected
    assert torch.equal(layer.weight, plain.weight)
    other = cutlass_ext.FusedLoRALinear(24, 40, r=8, bias=bias, device=device)
    other.load_state_dict(sd)
    for key, value in other.state_dict().items():
        assert torch.equal(value, sd[key]), key


@pytest.mark.parametrize("bias", [True, False])
def test_from_linear_shares_storage(device, bias):
    plain = nn.Linear(32, 16, bias=bias, device=device, dtype=torch.bfloat16)
    layer = cutlass_ext.FusedLoRALinear.from_linear(plain, r=4, lora_alpha=8, activation="gelu")
    assert layer.weight is plain.weight and layer.weight.data_ptr() == plain.weight.data_ptr()
    assert layer.bias is plain.bias
    assert not plain.weight.requires_grad and (plain.bias is None or not plain.bias.requires_grad)
    assert layer.lora_A.weight.dtype == torch.bfloat16 and layer.scaling == 2.0
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(3, 7, 32, device=device, dtype=torch.bfloat16)
    peer = F.gelu(plain(x) + layer.scaling * F.linear(F.linear(x, layer.lora_A.weight), layer.lora_B.weight))
    assert_close_to_reference(layer(x), lora_ref(layer, x), peer, "bf16")


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
def test_forward_matches_formula(device, activation):
    layer = cutlass_ext.FusedLoRALinear(48, 40, r=8, lora_alpha=32, activation=activation, device=device)
    nn.init.normal_(layer.lora_B.weight, std=0.1)
    x = torch.randn(2, 9, 48, device=device)
    with fp32_precision("fp32"):
        assert_close_to_reference(layer(x), lora_ref(layer, x), None, "fp32")


def test_merge_and_unmerge(device):
    layer = cutlass_ext.FusedLoRALinear(48, 40, r=8, activation="relu", device=device)
    nn.init.normal_(layer.lora_B.weight, std=0.1)
    x = torch.randn(11, 48, device=device)
    original = layer.weight.detach().clone()
    ptr = layer.weight.data_ptr()
    with fp32_precision("fp32"), torch.no_grad():
        unmerged = layer(x)
        layer.merge()
        assert layer.merged and layer.weight.data_ptr() == ptr and not torch.equal(layer.weight, original)
        assert "merged=True" in repr(layer)
        torch.testing.assert_close(layer(x), unmerged, rtol=1e-4, atol=1e-4)
        with pytest.raises(RuntimeError, match="already merged"):
            layer.merge()
        layer.unmerge()
        assert not layer.merged
        torch.testing.assert_close(layer.weight, original, rtol=0, atol=1e-5)
        torch.testing.assert_close(layer(x), unmerged, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()


def test_merged_forward_is_one_fused_linear(device):
    layer = cutlass_ext.FusedLoRALinear(16, 8, r=2, activation="gelu", device=device)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(4, 16, device=device)
    layer.merge()
    with fp32_precision("fp32"), torch.no_grad():
        expected = cutlass_ext.linear(x, layer.weight.t(), layer.bias, activation="gelu")
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=0)


def test_reset_lora_parameters_refuses_while_merged():
    layer = cutlass_ext.FusedLoRALinear(16, 8, r=2)
    layer.merge()
    with pytest.raises(RuntimeError, match="unmerge"):
        layer.reset_lora_parameters()


@pytest.mark.parametrize("r", [1, 4, 16])
def test_scaling_and_rslora(r):
    assert cutlass_ext.FusedLoRALinear(16, 8, r=r, lora_alpha=16).scaling == 16 / r
    assert cutlass_ext.FusedLoRALinear(16, 8, r=r, lora_alpha=16, use_rslora=True).scaling == 16 / math.sqrt(r)


def test_dropout_only_in_training(device):
    layer = cutlass_ext.FusedLoRALinear(64, 32, r=8, lora_dropout=0.5, device=device)
    nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(16, 64, device=device)
    with fp32_precision("fp32"), torch.no_grad():
        layer.train()
        first, second = layer(x), layer(x)
        assert not torch.equal(first, second)  # a fresh mask per call
        layer.eval()
        evaluated = layer(x)
        assert torch.equal(evaluated, layer(x))
        assert_close_to_reference(evaluated, lora_ref(layer, x), None, "fp32")
        no_dropout = cutlass_ext.FusedLoRALinear(64, 32, r=8, lora_dropout=0.0, device=device)
        no_dropout.load_state_dict(layer.state_dict())
        no_dropout.train()
        torch.testing.assert_close(no_dropout(x), evaluated, rtol=0, atol=0)


def test_training_reduces_loss(device):
    torch.manual_seed(0)
    base = nn.Linear(16, 8, device=device)
    target = nn.Linear(16, 8, device=device)
    layer = cutlass_ext.FusedLoRALinear.from_linear(base, r=8, lora_alpha=8)
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=3e-2)
    x = torch.randn(256, 16, device=device)
    with torch.no_grad():
        y = target(x)
    losses = []
    with fp32_precision("fp32"):
        for _ in range(80):
            opt.zero_grad()
            loss = (layer(x) - y).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


def test_extra_repr():
    text = repr(cutlass_ext.FusedLoRALinear(16, 8, r=4, lora_alpha=8, lora_dropout=0.1, activation="silu"))
    for part in ("in_features=16", "out_features=8", "r=4", "lora_alpha=8", "scaling=2", "lora_dropout=0.1",
                 "bias=True", "activation='silu'", "merged=False", "(lora_A): Linear"):
        assert part in text, part


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"r": 0}, ValueError, "r .* must be a positive int"),
        ({"r": 2.5}, ValueError, "r .* must be a positive int"),
        ({"lora_dropout": 1.5}, ValueError, "lora_dropout must be a probability"),
        ({"activation": "tanh"}, ValueError, "activation must be one of"),
    ],
)
def test_bad_arguments_are_rejected(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        cutlass_ext.FusedLoRALinear(16, 8, **kwargs)


def test_from_linear_rejects_other_modules():
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        cutlass_ext.FusedLoRALinear.from_linear(nn.Conv1d(3, 3, 1))


# ------------------------------------------------------------------------------------------------
# from_peft through duck typing: a stand-in with PEFT's LoRA Linear attributes (no peft needed)


class FakePeftLoraLinear(nn.Module):
    """The attributes of peft.tuners.lora.Linear that from_peft reads."""

    def __init__(self, in_f, out_f, r, alpha, p, adapter_dtype=None, names=("default",)):
        super().__init__()
        self.base_layer = nn.Linear(in_f, out_f).requires_grad_(False)
        self.lora_A = nn.ModuleDict({n: nn.Linear(in_f, r, bias=False, dtype=adapter_dtype) for n in names})
        self.lora_B = nn.ModuleDict({n: nn.Linear(r, out_f, bias=False, dtype=adapter_dtype) for n in names})
        self.lora_dropout = nn.ModuleDict({n: nn.Dropout(p) if p > 0 else nn.Identity() for n in names})
        self.scaling = {n: alpha / r for n in names}
        self.r = {n: r for n in names}
        self.lora_alpha = {n: alpha for n in names}
        self.active_adapters = list(names)
        self.merged_adapters = []


def test_from_peft_duck_typed_shares_weights():
    fake = FakePeftLoraLinear(24, 12, r=4, alpha=8, p=0.2)
    layer = cutlass_ext.FusedLoRALinear.from_peft(fake)
    assert layer.weight is fake.base_layer.weight and layer.bias is fake.base_layer.bias
    assert layer.lora_A is fake.lora_A["default"] and layer.lora_B is fake.lora_B["default"]
    assert (layer.r, layer.lora_alpha, layer.scaling, layer.lora_dropout) == (4, 8, 2.0, 0.2)
    assert not layer.merged and set(layer.state_dict()) == {"weight", "bias", "lora_A.weight", "lora_B.weight"}


def test_from_peft_casts_float32_adapters_to_the_base_dtype():
    fake = FakePeftLoraLinear(24, 12, r=4, alpha=8, p=0.0)
    fake.base_layer.to(torch.bfloat16)
    nn.init.normal_(fake.lora_B["default"].weight)
    layer = cutlass_ext.FusedLoRALinear.from_peft(fake)
    assert layer.lora_A.weight.dtype == torch.bfloat16 and layer.lora_A is not fake.lora_A["default"]
    torch.testing.assert_close(layer.lora_B.weight.float(), fake.lora_B["default"].weight, rtol=1e-2, atol=1e-2)
    assert layer.lora_A.weight.requires_grad


def test_from_peft_rejects_unsupported_layers():
    with pytest.raises(TypeError, match="missing .base_layer"):
        cutlass_ext.FusedLoRALinear.from_peft(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="exactly one active adapter"):
        cutlass_ext.FusedLoRALinear.from_peft(FakePeftLoraLinear(8, 8, 2, 4, 0.0, names=("a", "b")))
    fake = FakePeftLoraLinear(8, 8, 2, 4, 0.0)
    fake.lora_B["default"] = nn.Linear(2, 8, bias=True)
    with pytest.raises(NotImplementedError, match="lora_bias"):
        cutlass_ext.FusedLoRALinear.from_peft(fake)
    fake = FakePeftLoraLinear(8, 8, 2, 4, 0.0)
    fake.use_dora = {"default": True}
    with pytest.raises(NotImplementedError, match="DoRA"):
        cutlass_ext.FusedLoRALinear.from_peft(fake)
