"""Runs every kernel once on small CUDA inputs: meant to run under compute-sanitizer.

    compute-sanitizer --tool memcheck python bench/sanitize_check.py
    compute-sanitizer --tool racecheck python bench/sanitize_check.py

Shapes are awkward on purpose (odd widths, a strided view, a misaligned slice) so that the
scalar paths and the masked tails run too. Exits non-zero if an op raises.
"""

import torch

import remat


def run_all(device="cuda"):
    for backend in ("triton", "cuda"):
        if not remat.backends()[backend][0]:
            print(f"skip {backend}: {remat.backends()[backend][1]}")
            continue
        with remat.use_backend(backend):
            for dtype in (torch.float32, torch.bfloat16):
                for rows, width in ((3, 1), (7, 127), (5, 1000), (2, 8192), (2, 20000)):
                    big = torch.randn(rows, width + 3, device=device, dtype=dtype)
                    for x in (big[:, :width], big[:, 1:width + 1]):  # strided, then misaligned
                        x = x.detach().requires_grad_()
                        w = torch.randn(width, device=device, requires_grad=True)
                        b = torch.randn(width, device=device, requires_grad=True)
                        remat.layer_norm(x, (width,), w, b).sum().backward()
                        remat.gelu(x, "tanh", b).sum().backward()
                        remat.gelu(x, "none").sum().backward()
            q = torch.randn(1, 2, 37, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, 1, 45, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
            remat.attention(q, k, k, causal=True).sum().backward()
    torch.cuda.synchronize()
    print("sanitize_check: all ops ran")


if __name__ == "__main__":
    run_all()
