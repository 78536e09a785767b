#!/usr/bin/python3
"""The first steps of `mdlc run` replayed in PyTorch: the same tiny GPT-2 (gpt2_tiny.py), the same
packed batches, PyTorch's autograd for the gradients, torch.nn.utils.clip_grad_norm_ for the global
clipping, torch.optim.AdamW for the step, and the learning rate from the schedule's documented formula
(docs/language.md: linear warmup, then cosine decay to min_lr over `steps`, min_lr after them), written
here without mdl's code.

  train_replay.py DATA_SHARD WEIGHTS LOG CKPT_1 [CKPT_2 ...] --B 2 --T 16 --lr ... --warmup ...
      DATA_SHARD: the llm.c-format train shard the run read; WEIGHTS: the parameters it started from
      (--weights); LOG: the log.jsonl of the longest run; CKPT_k: the checkpoint after step k.
      Prints "[ok] replay ..." / "[fail] replay ...: why" per step and check; exits 1 on any failure.

Batches are those of mdl's loader with --no-shuffle (runtime/data/data.h, loader.c): the shard's tokens as
one stream; the rows of batch s (from 1) are the windows w = (s-1)*B .. s*B-1, window w being
stream[w*T, w*T + T + 1): tokens the first T, targets the next token; each EOS (token 0) starts a new
document: the doc id counts the EOS tokens seen in the row so far, the position restarts at 0 at it.

Checks per step k: the logged learning rate against the schedule (relative 1e-5: the log prints 6
digits), the logged loss and gradient norm (before clipping) against PyTorch's (relative 1e-4); every
parameter and both AdamW moments of CKPT_k against PyTorch's after k steps. Parameters are compared by
their change from WEIGHTS: max |(p_mdl - p0) - (p_torch - p0)| / max |p_torch - p0| < --tol (1e-2) per
tensor. A step moves an element by about lr (m / sqrt(v) is about +-1), so the bias correction one step
off (0.74 lr at step 1, 0.90 lr at step 3) or the learning rate one warmup step off is a large part of
it; fp32 rounding is not, except where a gradient element is near eps: there the update is about
lr * g / eps, and a gradient summed in another order moves it by lr * |dg| / eps (dg about 1e-6 of
the gradients' scale: 1.7e-4 of lr with the test's eps = 1e-5, 1.4e-3 with 1e-6).
The moments: relative to each tensor's largest element, < --moment-tol (1e-4; 1e-5 seen).
"""
import argparse
import fnmatch
import json
import math
import struct
import sys

import numpy as np
import torch

from gpt2_tiny import forward, read_safetensors, relative

EOS = 0


def read_shard(path):
    with open(path, "rb") as f:
        raw = f.read()
    header = struct.unpack("<256i", raw[:1024])
    if header[0] != 20240520 or header[1] != 1:
        raise SystemExit("%s: not an llm.c shard (magic %d, version %d)" % (path, header[0], header[1]))
    return np.frombuffer(raw[1024:], dtype="<u2", count=header[2]).astype(np.int64)


def batch_at(stream, step, B, T):
    tokens = np.zeros((B, T), dtype=np.int64)
    targets, pos, doc = np.zeros_like(tokens), np.zeros_like(tokens), np.zeros_like(tokens)
    rows = (len(stream) - 1) // T
    for r in range(B):
        w = ((step - 1) * B + r) % rows
        s = stream[w * T : w * T + T + 1]
        d, start = 0, 0
        for t in range(T):
            if s[t] == EOS:
                d, start = d + 1, t
            tokens[r, t], targets[r, t], pos[r, t], doc[r, t] = s[t], s[t + 1], t - start, d
    return {n: torch.tensor(a) for n, a in (("tokens", tokens), ("targets", targets), ("pos", pos), ("doc", doc))}


def lr_at(step, a):
    """Linear warmup to lr over `warmup` steps, then cosine from lr down to min_lr at step `steps`."""
    if a.warmup > 0 and step <= a.warmup:
        return a.lr * step / a.warmup
    if step >= a.steps:
        return a.min_lr
    progress = (step - a.warmup) / (a.steps - a.warmup)
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def report(label, rel, tol, detail=""):
    if rel < tol:
        print("[ok] replay %s (relative error %.2g)" % (label, rel))
        return 0
    print("[fail] replay %s: relative error %.3g > %.2g%s" % (label, rel, tol, detail))
    return 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shard")
    ap.add_argument("weights")
    ap.add_argument("log")
    ap.add_argument("ckpts", nargs="+")
    for name, kind in (("B", int), ("T", int), ("heads", int), ("lr", float), ("beta1", float), ("beta2", float),
                       ("eps", float), ("weight_decay", float), ("warmup", int), ("min_lr", float), ("steps", int),
                       ("clip", float)):
        ap.add_argument("--" + name, type=kind, required=True)
    ap.add_argument("--no-decay", action="append", default=[], help="a glob over parameter names")
    ap.add_argument("--tol", type=float, default=1e-2, help="for the parameters' changes")
    ap.add_argument("--moment-tol", type=float, default=1e-4)
    a = ap.parse_args()
    torch.set_num_threads(2)

    stream = read_shard(a.shard)
    w0 = read_safetensors(a.weights)
    w = {n: torch.tensor(x, dtype=torch.float32, requires_grad=True) for n, x in w0.items()}
    decays = lambda n: not any(fnmatch.fnmatchcase(n, p) for p in a.no_decay)
    groups = [{"params": [w[n] for n in w if decays(n)], "weight_decay": a.weight_decay},
              {"params": [w[n] for n in w if not decays(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    with open(a.log) as f:
        logged = {r["step"]: r for r in map(json.loads, f)}

    batches = [batch_at(stream, k, a.B, a.T) for k in range(1, len(a.ckpts) + 1)]
    bounds = sum(int((b["doc"][:, 1:] != b["doc"][:, :-1]).sum()) for b in batches)
    if bounds > 0:
        print("[ok] replay: the rows of the %d batches cross %d document boundaries" % (len(batches), bounds))
        failed = 0
    else:
        print("[fail] replay: no row of the %d batches crosses a document boundary: packing goes untested" % len(batches))
        failed = 1
    for k, ckpt_path in enumerate(a.ckpts, start=1):
        lr = lr_at(k, a)
        opt.zero_grad()
        loss = forward(w, batches[k - 1], a.heads)
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(list(w.values()), a.clip))
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()

        row = logged.get(k)
        if row is None:
            print("[fail] replay step %d: not in %s" % (k, a.log))
            failed += 1
        else:
            failed += report("step %d: logged lr %.6g, schedule %.6g" % (k, row["lr"], lr),
                             abs(row["lr"] - lr) / lr, 1e-5)
            failed += report("step %d: logged loss %.6f, PyTorch %.6f" % (k, row["loss"], loss.item()),
                             abs(row["loss"] - loss.item()) / abs(loss.item()), 1e-4)
            failed += report("step %d: logged grad norm %.6g, PyTorch %.6g (clip %g)" % (k, row["grad_norm"], norm, a.clip),
                             abs(row["grad_norm"] - norm) / norm, 1e-4)
        got = read_safetensors(ckpt_path)
        worst = {"param": (0.0, ""), "moment": (0.0, "")}
        for n, p in w.items():
            state = opt.state[p]
            pairs = [("param", n, got.get(n), p.detach().numpy().astype(np.float64)),
                     ("moment", n + ".m", got.get(n + ".m"), state["exp_avg"].numpy().astype(np.float64)),
                     ("moment", n + ".v", got.get(n + ".v"), state["exp_avg_sq"].numpy().astype(np.float64))]
            for kind, name, mine, ref in pairs:
                if mine is None or mine.shape != ref.shape:
                    print("[fail] replay step %d: %s %s in %s" % (k, name, "missing" if mine is None else
                                                                 "has shape %s" % list(mine.shape), ckpt_path))
                    failed += 1
                    continue
                if kind == "param":
                    mine, ref = mine.astype(np.float64) - w0[n], ref - w0[n]
                rel = relative(mine, ref)[0]
                worst[kind] = max(worst[kind], (rel, name))
        failed += report("step %d: every parameter's change after %d step%s (worst %s)" % (
            k, k, "s" if k > 1 else "", worst["param"][1]), worst["param"][0], a.tol)
        failed += report("step %d: both AdamW moments of every parameter (worst %s)" % (k, worst["moment"][1]),
                         worst["moment"][0], a.moment_tol)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
