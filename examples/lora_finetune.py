"""LoRA fine-tuning of a small MLP with FusedLoRALinear layers, next to the same model wrapped by PEFT
(or, where peft is not installed, a plain-PyTorch LoRA layer): same seed, same base weights, same
adapter init, same batches, AdamW. Prints both loss curves and step times, and exits non-zero if
the curves diverge beyond a tolerance. In bf16 two correct implementations round differently,
and after a few dozen AdamW steps their trajectories drift apart the way any two bf16 runs do;
there the curves are compared step by step over the first 25 steps, and both must then keep
falling (final loss below half the initial one).

The task: a frozen random "pretrained" MLP (4 linear layers, GELU between them) is adapted to a
teacher that differs from it by a rank-4 change of every weight, so rank-8 adapters can fit it.

    python examples/lora_finetune.py              # CUDA (bf16) if available, else CPU (fp32, small)
    python examples/lora_finetune.py --steps 100
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

import cutlass_ext

LAYERS = ("fc0", "fc1", "fc2", "fc3")


def make_base(width: int, device, dtype) -> nn.Sequential:
    """The frozen "pretrained" model: 4 nn.Linear layers with GELU between them."""
    sizes = [(width, width)] * 3 + [(width, width // 4)]
    mods = OrderedDict()
    for i, (name, (i_f, o_f)) in enumerate(zip(LAYERS, sizes)):
        mods[name] = nn.Linear(i_f, o_f, device=device, dtype=dtype)
        if i < len(LAYERS) - 1:
            mods[f"act{i}"] = nn.GELU()
    return nn.Sequential(mods).requires_grad_(False)


def make_teacher(base: nn.Sequential, rank: int = 4) -> nn.Sequential:
    """base with a rank-``rank`` change added to every weight: what the adapters should learn."""
    teacher = copy.deepcopy(base)
    with torch.no_grad():
        for name in LAYERS:
            w = getattr(teacher, name).weight
            u = torch.randn(w.shape[0], rank, device=w.device, dtype=torch.float32)
            v = torch.randn(rank, w.shape[1], device=w.device, dtype=torch.float32)
            w += (0.5 / math.sqrt(rank * w.shape[1]) * (u @ v)).to(w.dtype)
    return teacher


class TorchLoRALinear(nn.Module):
    """The LoRA formula in plain PyTorch: base(x) + lora_B(lora_A(dropout(x))) * scaling."""

    def __init__(self, base: nn.Linear, r: int, lora_alpha: float):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, r, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = lora_alpha / r

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def make_peer(base: nn.Sequential, r: int, lora_alpha: float):
    """(name, model): PEFT's LoRA around a copy of base, or the plain-PyTorch formula without peft."""
    base = copy.deepcopy(base)
    try:
        import peft
    except ImportError:
        for name in LAYERS:
            setattr(base, name, TorchLoRALinear(getattr(base, name), r, lora_alpha))
        return "torch LoRA", base
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(LAYERS), lora_dropout=0.0)
    # Adapters in the base's dtype (PEFT would otherwise keep float32 adapters over a bf16 base).
    return f"PEFT {peft.__version__}", peft.get_peft_model(base, config, autocast_adapter_dtype=False)


def peer_adapter(peer: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    layer = peer.get_submodule(name) if not hasattr(peer, "base_model") else peer.base_model.model.get_submodule(name)
    if isinstance(layer, TorchLoRALinear):
        return layer.lora_A.weight, layer.lora_B.weight
    return layer.lora_A["default"].weight, layer.lora_B["default"].weight


def make_fused(base: nn.Sequential, peer: nn.Module, r: int, lora_alpha: float) -> nn.Sequential:
    """FusedLoRALinear layers around a copy of base (GELU fused into the first three), adapters copied
    from the peer so that both start from the same point."""
    base = copy.deepcopy(base)
    layers = []
    for i, name in enumerate(LAYERS):
        act = "gelu" if i < len(LAYERS) - 1 else None
        layer = cutlass_ext.FusedLoRALinear.from_linear(getattr(base, name), r=r, lora_alpha=lora_alpha, activation=act)
        a, b = peer_adapter(peer, name)
        with torch.no_grad():
            layer.lora_A.weight.copy_(a)
            layer.lora_B.weight.copy_(b)
        layers.append(layer)
    return nn.Sequential(*layers)


def train(model: nn.Module, batches, targets, lr: float):
    """AdamW on the trainable (adapter) parameters; returns (per-step relative-MSE losses, seconds per
    step)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses = []
    if batches[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in zip(batches, targets):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), y) / y.square().mean()  # relative: 1 = predicting zeros
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    if batches[0].is_cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / len(batches)
    return torch.stack(losses).tolist(), seconds


def diverged(ours, theirs, rtol: float, atol: float) -> list[int]:
    """Steps where |ours - theirs| > rtol * max(ours, theirs) + atol * theirs[0]."""
    return [i for i, (a, b) in enumerate(zip(ours, theirs)) if abs(a - b) > rtol * max(a, b) + atol * theirs[0]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="default 200 on CUDA, 40 on CPU")
    parser.add_argument("--r", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    width, tokens = (1024, 8192) if cuda else (128, 256)
    steps = args.steps or (200 if cuda else 40)
    rtol, atol = (0.1, 0.01) if dtype == torch.bfloat16 else (0.02, 1e-3)

    torch.manual_seed(0)
    base = make_base(width, device, dtype)
    teacher = make_teacher(base)
    batches = [torch.randn(tokens, width, device=device, dtype=dtype) for _ in range(steps)]
    with torch.no_grad():
        targets = [teacher(x).float() for x in batches]

    def models():
        torch.manual_seed(1)
        peer_name, peer = make_peer(base, args.r, args.lora_alpha)
        return peer_name, peer, make_fused(base, peer, args.r, args.lora_alpha)

    # Warm-up (the one-time extension build on CUDA, allocator, kernel selection) on throwaway copies.
    peer_name, peer, fused = models()
    for model in (peer, fused):
        train(model, batches[:3], targets[:3], args.lr)

    peer_name, peer, fused = models()
    print(f"device {device}, {dtype}, width {width}, {tokens} tokens/step, r={args.r}, "
          f"lora_alpha={args.lora_alpha}, {steps} AdamW steps")
    results = {}
    for name, model in ((peer_name, peer), ("FusedLoRALinear", fused)):
        losses, seconds = train(model, batches, targets, args.lr)
        results[name] = losses
        curve = "  ".join(f"{s}:{losses[s]:.5f}" for s in range(0, steps, max(1, steps // 8)))
        print(f"{name:16s} {seconds * 1e3:8.2f} ms/step  loss {curve}  final {losses[-1]:.5f}")

    compared = 25 if dtype == torch.bfloat16 else steps
    bad = diverged(results["FusedLoRALinear"][:compared], results[peer_name][:compared], rtol, atol)
    if bad:
        i = bad[0]
        print(f"FAIL: loss curves diverge at {len(bad)} steps (first: step {i}, FusedLoRALinear "
              f"{results['FusedLoRALinear'][i]:.5f} vs {peer_name} {results[peer_name][i]:.5f}; "
              f"rtol {rtol}, atol {atol} x initial loss)")
        return 1
    for name, losses in results.items():
        if not losses[-1] < 0.5 * losses[0]:
            print(f"FAIL: {name}'s loss did not fall below half its initial value")
            return 1
    print(f"OK: loss curves agree within rtol {rtol} (+ {atol} x initial loss) over the first {compared} "
          "steps, and both fall below half the initial loss")
    return 0


if __name__ == "__main__":
    sys.exit(main())
