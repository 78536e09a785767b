#!/usr/bin/python3
"""PyTorch eager training speed of the GPT-2 of models/gpt2*.mdl: same architecture, batch, fp32,
AdamW, thread count; the baseline `make bench` compares mdlc against.

  torch_gpt.py --V 256 --maxT 128 --C 64 --H 4 --L 2 --B 8 --T 64 --steps 20 --threads 2
prints one line: "torch eager: <tok/s> tok/s (median of N steps, after 3 warm-up steps)".
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "torch"))
from gpt2_tiny import forward  # noqa: E402  the cross-checked model


def params(V, maxT, C, L, gen):
    w = {"wte": torch.randn(V, C, generator=gen) * 0.02, "wpe": torch.randn(maxT, C, generator=gen) * 0.01}
    for l in range(L):
        p = "h.%d." % l
        w.update({p + "ln1_w": torch.ones(C), p + "ln1_b": torch.zeros(C),
                  p + "attn_w": torch.randn(C, 3 * C, generator=gen) * 0.02, p + "attn_b": torch.zeros(3 * C),
                  p + "proj_w": torch.randn(C, C, generator=gen) * 0.02, p + "proj_b": torch.zeros(C),
                  p + "ln2_w": torch.ones(C), p + "ln2_b": torch.zeros(C),
                  p + "fc_w": torch.randn(C, 4 * C, generator=gen) * 0.02, p + "fc_b": torch.zeros(4 * C),
                  p + "fcproj_w": torch.randn(4 * C, C, generator=gen) * 0.02, p + "fcproj_b": torch.zeros(C)})
    w["lnf_w"], w["lnf_b"] = torch.ones(C), torch.zeros(C)
    return {n: t.requires_grad_() for n, t in w.items()}


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(V=256, maxT=128, C=64, H=4, L=2, B=8, T=64, steps=20, threads=os.cpu_count()).items():
        ap.add_argument("--" + k, type=int, default=v)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    w = params(a.V, a.maxT, a.C, a.L, gen)
    opt = torch.optim.AdamW(w.values(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tokens = torch.randint(0, min(a.V, 256), (a.B, a.T + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "pos": torch.arange(a.T).expand(a.B, a.T),
             "doc": torch.zeros(a.B, a.T, dtype=torch.long)}
    times = []
    for step in range(a.steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = forward(w, batch, a.H)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(w.values(), 1.0)
        opt.step()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    print("torch eager: %.0f tok/s (median of %d steps, after 3 warm-up steps, %d threads, loss %.3f)"
          % (a.B * a.T / statistics.median(times), len(times), a.threads, loss.item()))


if __name__ == "__main__":
    main()
