"""The peer `make bench` measures mdlc against: GPT-2 (models/gpt2*.mdl's architecture) as a PyTorch user
writes it, nanoGPT style: nn.Linear layers, F.scaled_dot_product_attention with is_causal (PyTorch's
flash attention kernel on the CPU), tanh GELU, tied embeddings, cross-entropy, AdamW with clipping at
1.0; eager or torch.compile; fp32, or bf16 autocast (oneDNN's AMX kernels where the CPU has them).

  torch_gpt.py --V 256 --maxT 128 --C 64 --H 4 --L 2 --B 8 --T 64 --steps 20 --threads 2 [--compile] [--bf16] [--muon]

--muon trains the blocks' matrices with torch.optim.Muon (lr 0.02, momentum 0.95, Nesterov; PyTorch's
Newton-Schulz, 5 steps) and the other params with AdamW at 3e-4, as `optimizer = muon` in mdl does.

prints one line:
  torch eager fp32: <tok/s> tok/s (median of N steps after 3 warm-up steps; first step <s> s; peak RSS <MB> MB)
The first step includes torch.compile's compilation (its cache in TORCHINDUCTOR_CACHE_DIR).
"""
import argparse
import os
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fcproj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V, maxT, C, H, L):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(maxT, C)
        self.h = nn.ModuleList(Block(C, H) for _ in range(L))
        self.lnf = nn.LayerNorm(C)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for b in self.h:
            x = b(x)
        logits = self.lnf(x) @ self.wte.weight.T
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(V=256, maxT=128, C=64, H=4, L=2, B=8, T=64, steps=20, threads=os.cpu_count()).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--muon", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a.V, a.maxT, a.C, a.H, a.L)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    if a.muon:
        hidden = [p for n, p in model.named_parameters() if n.startswith("h.") and p.dim() == 2]
        rest = [p for n, p in model.named_parameters() if not (n.startswith("h.") and p.dim() == 2)]
        opts = [torch.optim.Muon(hidden, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0),
                torch.optim.AdamW(rest, lr=3e-4, betas=(0.9, 0.95), eps=1e-10)]
    else:
        opts = [torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                                  lr=1e-3, betas=(0.9, 0.95), eps=1e-8)]
    step_model = torch.compile(model) if a.compile else model
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, min(a.V, 256), (a.B, a.T + 1), generator=gen)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    times = []
    for step in range(a.steps + 3):
        t0 = time.perf_counter()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
            loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            opt.step()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("torch %s %s%s: %.0f tok/s (median of %d steps after 3 warm-up steps; first step %.2f s; peak RSS %.0f MB; "
          "loss %.3f)" % ("compile" if a.compile else "eager", "bf16" if a.bf16 else "fp32", " muon" if a.muon else "",
                          a.B * a.T / statistics.median(times[3:]), a.steps, times[0], rss, loss.item()))


if __name__ == "__main__":
    main()
