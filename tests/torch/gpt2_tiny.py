#!/usr/bin/python3
"""The tiny GPT-2 of models/gpt2-tiny.mdl written in PyTorch, with exactly the .mdl's semantics,
used to cross-check the loss and every gradient that `mdlc grad` computes.

  gpt2_tiny.py batch OUT.safetensors [--B 2] [--T 16] [--seed 1]
      writes a packed batch: tokens, targets, pos, doc (i32 [B,T]); every row holds two documents,
      pos restarts at each document, a target is the next token of the same document (-1 at a
      document's last position).
  gpt2_tiny.py check WEIGHTS BATCH GRADS [--heads 4] [--bf16] [--tol 1e-4]
      computes the loss and the gradient of every parameter in fp32 and compares them with GRADS
      ("loss" and one tensor per parameter): relative error max|diff| / max|ref| < tol per tensor.
      Prints "[ok] torch ..." / "[fail] torch ...: why" per tensor; exits 1 on any failure.
      With --bf16 every matmul rounds its operands to bf16 (nearest, ties to even) and accumulates
      in fp32, and its backward rounds the incoming gradient likewise before the two GEMMs; the
      cross-entropy reads the logits rounded to bf16 (the rounding passes the gradient through): the
      semantics of `mdlc --precision bf16`, written here without mdl's code. It then also checks
      that the bf16 loss and gradients differ from the fp32 ones by more than tol somewhere, so that
      the comparison can tell the two precisions apart.

Model (names as in the .mdl; shapes follow from the weights): x = wte[tokens] + wpe[pos]; per layer
l: q, k, v = split(layernorm(x) @ attn_w + attn_b); x += attention(q, k, v) @ proj_w + proj_b with
causal and same-document masking, scale 1/sqrt(C/H); x += gelu_tanh(layernorm(x) @ fc_w + fc_b)
@ fcproj_w + fcproj_b; logits = layernorm_f(x) @ wte.T; loss = the mean of the per-position
cross-entropy over the positions whose target counts (>= 0; -1 is ignored), PyTorch's own
F.cross_entropy(..., ignore_index=-1, reduction="mean"), as the .mdl's mean(cross_entropy(...)).
Weights are stored as x @ W ([in, out]), not nn.Linear's transposed layout. The safetensors reader
and writer are our own (json + numpy), since the `safetensors` package is not assumed.
"""
import argparse
import json
import math
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"F32": "<f4", "I32": "<i4", "F64": "<f8"}


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen].decode("utf-8"))
    data = raw[8 + hlen :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        buf = data[begin:end]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(buf, dtype=DTYPES[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).copy()
    return out


def write_safetensors(path, tensors):
    header, chunks, off = {}, [], 0
    for name, arr in tensors.items():
        tag = {np.dtype("float32"): "F32", np.dtype("int32"): "I32"}[arr.dtype]
        b = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    h = json.dumps(header).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(chunks))


def make_batch(path, B, T, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, size=(B, T), dtype=np.int64).astype(np.int32)
    doc = np.zeros((B, T), dtype=np.int32)
    pos = np.zeros((B, T), dtype=np.int32)
    targets = np.full((B, T), -1, dtype=np.int32)
    for b in range(B):
        split = int(rng.integers(T // 4, T - T // 4))
        doc[b, split:] = 1
        pos[b, :split] = np.arange(split)
        pos[b, split:] = np.arange(T - split)
        for t in range(T - 1):
            if doc[b, t + 1] == doc[b, t]:
                targets[b, t] = tokens[b, t + 1]
    write_safetensors(path, {"tokens": tokens, "targets": targets, "pos": pos, "doc": doc})


def round_bf16(t):
    return t.to(torch.bfloat16).to(torch.float32)


class RoundBf16(torch.autograd.Function):
    """x rounded to bf16 in the forward; the gradient passes through as it is (mdl rounds the logits
    by a CAST that the precision pass inserts after autodiff: it has no backward of its own)."""

    @staticmethod
    def forward(ctx, x):
        return round_bf16(x)

    @staticmethod
    def backward(ctx, g):
        return g


class Bf16Attention(torch.autograd.Function):
    """mdl's bf16 attention (compiler/mdl.h) on heads [B, H, T, D]: every product reads bf16 operands
    (q, k and v; the numerators e = exp(s - max), divided by their unrounded sum; in the backward
    dout, P and dS), sums are fp32; P stays exact in dS = P (dP - D), where D = bf(dout) . bf(out)
    per row, out being the forward's output."""

    @staticmethod
    def forward(ctx, q, k, v, allowed, scale):
        qr, kr, vr = round_bf16(q), round_bf16(k), round_bf16(v)
        s = ((qr @ kr.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
        e = torch.exp(s - s.amax(dim=-1, keepdim=True))
        l = e.sum(dim=-1, keepdim=True)
        out = (round_bf16(e) @ vr) / l
        ctx.save_for_backward(qr, kr, vr, e / l, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        qr, kr, vr, p, out = ctx.saved_tensors
        dor = round_bf16(dout)
        dp = dor @ vr.transpose(-1, -2)
        ds = p * (dp - (dor * round_bf16(out)).sum(dim=-1, keepdim=True))
        dsr = round_bf16(ds)
        dq = ctx.scale * (dsr @ kr)
        dk = ctx.scale * (dsr.transpose(-1, -2) @ qr)
        dv = round_bf16(p).transpose(-1, -2) @ dor
        return dq, dk, dv, None, None


def attention(q, k, v, doc, heads, bf16=False):
    B, T, C = q.shape
    D = C // heads
    q, k, v = (t.view(B, T, heads, D).transpose(1, 2) for t in (q, k, v))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    same_doc = doc[:, :, None] == doc[:, None, :]
    allowed = (causal[None] & same_doc)[:, None]  # [B, 1, T, T]
    if bf16:
        return Bf16Attention.apply(q, k, v, allowed, 1.0 / math.sqrt(D)).transpose(1, 2).reshape(B, T, C)
    scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (p @ v).transpose(1, 2).reshape(B, T, C)


class Bf16MatMul(torch.autograd.Function):
    """a @ b on operands rounded to bf16, fp32 accumulation; the backward GEMMs read the gradient
    rounded to bf16 and the same rounded operands."""

    @staticmethod
    def forward(ctx, a, b):
        ar, br = round_bf16(a), round_bf16(b)
        ctx.save_for_backward(ar, br)
        return ar @ br

    @staticmethod
    def backward(ctx, dy):
        ar, br = ctx.saved_tensors
        dyr = round_bf16(dy)
        return dyr @ br.transpose(-1, -2), ar.transpose(-1, -2) @ dyr


def matmul(a, b, bf16):
    return Bf16MatMul.apply(a, b) if bf16 else a @ b


def forward(w, batch, heads, bf16=False):
    C = w["wte"].shape[1]
    L = sum(1 for name in w if name.startswith("h.") and name.endswith(".ln1_w"))
    ln = lambda x, g, b: F.layer_norm(x, (C,), g, b, 1e-5)
    x = w["wte"][batch["tokens"]] + w["wpe"][batch["pos"]]
    for l in range(L):
        p = lambda n: w["h.%d.%s" % (l, n)]
        mm = lambda a, b: matmul(a.reshape(-1, a.shape[-1]), b, bf16).reshape(*a.shape[:-1], b.shape[-1])
        q, k, v = (mm(ln(x, p("ln1_w"), p("ln1_b")), p("attn_w")) + p("attn_b")).split(C, dim=-1)
        x = x + mm(attention(q, k, v, batch["doc"], heads, bf16), p("proj_w")) + p("proj_b")
        h = F.gelu(mm(ln(x, p("ln2_w"), p("ln2_b")), p("fc_w")) + p("fc_b"), approximate="tanh")
        x = x + mm(h, p("fcproj_w")) + p("fcproj_b")
    xf = ln(x, w["lnf_w"], w["lnf_b"])
    logits = matmul(xf.reshape(-1, C), w["wte"].T, bf16).reshape(*xf.shape[:-1], -1)
    if bf16:
        logits = RoundBf16.apply(logits)  # the loss reads the logits as autocast leaves them
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V), batch["targets"].reshape(-1).long(), ignore_index=-1,
                           reduction="mean")


def reference(weights, batch, heads, bf16):
    w = {n: torch.tensor(a, dtype=torch.float32, requires_grad=True) for n, a in weights.items()}
    loss = forward(w, batch, heads, bf16)
    loss.backward()
    ref = {"loss": loss.detach().numpy().astype(np.float64)}
    ref.update({n: t.grad.numpy().astype(np.float64) for n, t in w.items()})
    return ref


def relative(a, ref):
    diff = np.max(np.abs(a.astype(np.float64) - ref), initial=0.0)
    scale = np.max(np.abs(ref), initial=0.0)
    return (diff / scale if scale > 0 else diff), diff, scale


def check(weights_path, batch_path, grads_path, heads, bf16, tol):
    torch.set_num_threads(2)
    weights = read_safetensors(weights_path)
    batch = {n: torch.tensor(a.astype(np.int64)) for n, a in read_safetensors(batch_path).items()}
    got = read_safetensors(grads_path)
    ref = reference(weights, batch, heads, bf16)
    failed = 0
    if bf16:
        fp32 = reference(weights, batch, heads, False)
        apart = max(relative(fp32[n], ref[n])[0] for n in ref)
        if apart > tol:
            print("[ok] torch bf16 differs from fp32 (largest relative difference %.2g > %.2g)" % (apart, tol))
        else:
            print("[fail] torch bf16 differs from fp32 by %.2g only: tolerance %.2g cannot tell them apart" % (apart, tol))
            failed += 1
    for name in sorted(set(ref) | set(got), key=lambda n: (n != "loss", n)):
        label = ("torch %sloss" if name == "loss" else "torch %sgrad " + name) % ("bf16 " if bf16 else "")
        if name not in got:
            print("[fail] %s: missing from %s" % (label, grads_path))
        elif name not in ref:
            print("[fail] %s: %s has a tensor the model does not" % (label, grads_path))
        elif got[name].shape != ref[name].shape:
            print("[fail] %s: shape %s, PyTorch has %s" % (label, list(got[name].shape), list(ref[name].shape)))
        else:
            rel, diff, scale = relative(got[name], ref[name])
            if rel < tol:
                print("[ok] %s (relative error %.2g)" % (label, rel))
                continue
            print("[fail] %s: relative error %.3g (max |diff| %.3g, max |ref| %.3g)" % (label, rel, diff, scale))
        failed += 1
    return failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("batch")
    b.add_argument("out")
    b.add_argument("--B", type=int, default=2)
    b.add_argument("--T", type=int, default=16)
    b.add_argument("--seed", type=int, default=1)
    c = sub.add_parser("check")
    c.add_argument("weights")
    c.add_argument("batch")
    c.add_argument("grads")
    c.add_argument("--heads", type=int, default=4)
    c.add_argument("--bf16", action="store_true")
    c.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    if args.cmd == "batch":
        make_batch(args.out, args.B, args.T, args.seed)
        return 0
    return 1 if check(args.weights, args.batch, args.grads, args.heads, args.bf16, args.tol) else 0


if __name__ == "__main__":
    sys.exit(main())
