"""Reference parameters for tests/unit/test_interp.c's optimizer tests (test_optimizers, test_muon):
10 steps of each optimizer on one parameter of 5 values, from p0 with the gradients g_t (below),
printed as C literals. SGD and AdamW are torch.optim's; Lion is the update rule of Chen et al. 2023
("Symbolic Discovery of Optimization Algorithms", Algorithm 2), written out here in torch, since
torch has none. Muon is Keller Jordan's (github.com/KellerJordan/Muon, muon.py: muon_update and
SingleDeviceMuon's step), on a wide 3 x 5 and a tall 5 x 3 matrix, in float64 where it runs the
Newton-Schulz iterations in bfloat16 (the interpreter's double is the oracle here).
Run: ~/.cache/mdl/bench-venv/bin/python tests/torch/optim_ref.py (any torch with float64)."""
import math

import torch

torch.set_default_dtype(torch.float64)
P0 = [1.0, -2.0, 0.5, 0.0, 3.0]
STEPS = 10


def grad(t):  # the gradient at step t (1-based), as test_interp.c computes it (Muon's: muon_run)
    return torch.tensor([math.sin(1.3 * t + 0.7 * i) * (1 + 0.1 * i) for i in range(len(P0))])


def torch_run(make):
    p = torch.nn.Parameter(torch.tensor(P0))
    opt = make([p])
    for t in range(1, STEPS + 1):
        p.grad = grad(t)
        opt.step()
    return p.detach().tolist()


def lion_run(lr, beta1, beta2, wd):
    p, m = torch.tensor(P0), torch.zeros(len(P0))
    for t in range(1, STEPS + 1):
        g = grad(t)
        c = beta1 * m + (1 - beta1) * g
        p = p - lr * (torch.sign(c) + wd * p)
        m = beta2 * m + (1 - beta2) * g
    return p.tolist()


cases = [
    ("sgd(lr=0.1, momentum=0.9, weight_decay=0.01)",
     torch_run(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01))),
    ("sgd(lr=0.1, momentum=0.9, nesterov=true, weight_decay=0.01), lr_scale 0.5",
     torch_run(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01))),
    ("sgd(lr=0.1, weight_decay=0.1)", torch_run(lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1))),
    ("adamw(lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)",
     torch_run(lambda ps: torch.optim.AdamW(ps, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01))),
    ("lion(lr=0.03, beta1=0.9, beta2=0.99, weight_decay=0.1)", lion_run(0.03, 0.9, 0.99, 0.1)),
]


def ns5(G):  # zeropower_via_newtonschulz5, in float64
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.clone()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_run(rows, cols, lr, beta, wd, nesterov):
    n = rows * cols
    p = torch.tensor([0.1 * math.cos(0.9 * i) for i in range(n)]).reshape(rows, cols)
    m = torch.zeros(rows, cols)
    for t in range(1, STEPS + 1):
        # (a phase quadratic in i: full rank and well conditioned, where 0.7 i gave a matrix of rank
        # about 2, whose smallest singular direction Newton-Schulz amplifies rounding noise along)
        g = torch.tensor([math.sin(1.3 * t + 0.37 * i * i) * (1 + 0.1 * i) for i in range(n)]).reshape(rows, cols)
        g = g.float().double()  # (the test's gradients are f32 inputs)
        m.lerp_(g, 1 - beta)
        u = g.lerp(m, beta) if nesterov else m
        u = ns5(u) * max(1, rows / cols) ** 0.5
        p.mul_(1 - lr * wd)
        p.add_(u, alpha=-lr)
    return p.flatten().tolist()


cases += [
    ("muon(lr=0.02, momentum=0.95, weight_decay=0.1), 3 x 5", muon_run(3, 5, 0.02, 0.95, 0.1, True)),
    ("muon(lr=0.02, momentum=0.95, weight_decay=0.1), 5 x 3", muon_run(5, 3, 0.02, 0.95, 0.1, True)),
    ("muon(lr=0.05, momentum=0.9, nesterov=false), 3 x 5", muon_run(3, 5, 0.05, 0.9, 0, False)),
    ("muon(lr=0.05, momentum=0.9, nesterov=false), 5 x 3", muon_run(5, 3, 0.05, 0.9, 0, False)),
]
print("// made by tests/torch/optim_ref.py with torch %s" % torch.__version__)
for name, p in cases:
    print("    {%s}, // %s" % (", ".join(repr(x) for x in p), name))
