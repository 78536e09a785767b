# PyTorch's attention (scaled_dot_product_attention, its CPU flash attention) at the shapes of the
# attention rows of bench/RESULTS.md: B=2, H=4, T=512, D=64, causal, forward and backward, fp32 and
# bf16, median of 20 calls after 5, on the threads given. Run with the bench's PyTorch from PyPI:
#   ~/.cache/mdl/bench-venv/bin/python bench/torch_sdpa.py [--threads 2]
import argparse
import statistics
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()
torch.set_num_threads(args.threads)
B, H, T, D = 2, 4, 512, 64
flops_fwd = 4 * B * T * T * D * H / 2  # causal, as mdlc's fusion report counts it
for dt in (torch.float32, torch.bfloat16):
    q, k, v = (torch.randn(B, H, T, D, dtype=dt, requires_grad=True) for _ in range(3))
    fwd, bwd = [], []
    for i in range(25):
        t0 = time.perf_counter()
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        t1 = time.perf_counter()
        o.backward(torch.randn_like(o))
        t2 = time.perf_counter()
        if i >= 5:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    f, b = statistics.median(fwd), statistics.median(bwd)
    print(f"{dt}: forward {f * 1e3:.3f} ms ({flops_fwd / f / 1e9:.0f} GFLOP/s), "
          f"backward {b * 1e3:.3f} ms ({2 * flops_fwd / b / 1e9:.0f} GFLOP/s)")
