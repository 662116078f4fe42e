"""Train a small MLP of FusedLinear layers on a synthetic regression task, next to the same model
built from nn.Linear + activation, and print both loss curves and step times.

    python examples/linear_example.py            # CUDA if available, else CPU (reference kernels)
"""

import time

import torch
from torch import nn

import cutlass_ext


def make_models(device, dtype):
    torch.manual_seed(0)
    sizes, acts = [(256, 1024), (1024, 1024), (1024, 1)], ["gelu", "relu", None]
    torch_act = {"gelu": nn.GELU, "relu": nn.ReLU, None: nn.Identity}
    linears = [nn.Linear(i, o, device=device, dtype=dtype) for i, o in sizes]
    plain = nn.Sequential(*[m for lin, a in zip(linears, acts) for m in (lin, torch_act[a]())])
    fused = nn.Sequential(*[cutlass_ext.FusedLinear(i, o, activation=a, device=device, dtype=dtype)
                            for (i, o), a in zip(sizes, acts)])
    for lin, layer in zip(linears, fused):
        layer.load_state_dict(lin.state_dict())  # same start, same state_dict keys
    return plain, fused


def train(model, x, y, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = (model(x).float() - y).square().mean()
        loss.backward()
        opt.step()
        if step % 20 == 0 or step == steps - 1:
            losses.append((step, loss.item()))
    if x.is_cuda:
        torch.cuda.synchronize()
    return losses, (time.perf_counter() - start) / steps


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = torch.randn(8192, 256, device=device, dtype=dtype)
    y = (x[:, :8].float().sin().sum(1, keepdim=True) + 0.1 * x[:, 8:16].float().square().sum(1, keepdim=True))
    plain, fused = make_models(device, dtype)
    for name, model in (("nn.Linear + act", plain), ("FusedLinear", fused)):
        train(model, x, y, 3)  # warm-up (and the one-time extension build)
    plain, fused = make_models(device, dtype)
    for name, model in (("nn.Linear + act", plain), ("FusedLinear", fused)):
        losses, step_time = train(model, x, y, 200 if device == "cuda" else 40)
        curve = "  ".join(f"{s}:{l:.4f}" for s, l in losses[::2])
        print(f"{name:16s} {step_time * 1e3:7.2f} ms/step  loss {curve}")


if __name__ == "__main__":
    main()
