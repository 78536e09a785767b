#!/usr/bin/env python3
# layers.py: checks the house rules that keep mdl's parts apart (docs/internals.md, "Layers"), over the
# sources and the built objects:
#   1. layers: base (compiler/mdl.h, compiler/base/) and kernels (runtime/kernels/, the module text and
#      its ABI) at the bottom; the compiler (grammar/, compiler/front, passes, emit, pipeline.c) and the
#      runtime (runtime/) above them, side by side: the runtime reads the compiler's types (its headers)
#      but calls no compiler function, the compiler neither includes nor calls the runtime; the driver
#      (compiler/driver/) on top, the only code that uses both. Calls are read from the objects'
#      symbol tables (nm), includes from the sources.
#   2. no circles: no two source files call each other, directly or around a loop (the call graph
#      between objects), and no header includes itself around a loop.
#   3. size: no source file over 1,500 lines; no function over 200 lines but the op switches named in
#      LONG_OK.
# Prints "[ok] ..." or "[fail] ..." per rule; `--list` prints every file's layer.
# Usage: tools/layers.py [--root DIR] [--build DIR] [--list] (defaults: this tree and its build/; `make`
# first).
import os
import re
import subprocess
import sys

def arg(name, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv[:-1] else default


ROOT = os.path.abspath(arg("--root", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")))
BUILD = arg("--build", "build")
MAX_FILE_LINES = 1500
MAX_FUNC_LINES = 200
LONG_OK = {"infer", "backward_rule"}  # the op switches: one case per op, each short

# who may use whom (calls and includes); a layer always uses itself
USES = {
    "base": {"base"},
    "kernels": {"kernels"},
    "compiler": {"base", "kernels"},
    "runtime": {"base", "kernels"},
    "driver": {"base", "kernels", "compiler", "runtime"},
}
# bison's parser and flex's scanner call each other (yylex, yyparse): one part, written as grammar/
PARSER = ("build/mdl.tab.c", "build/lex.yy.c")
# the runtime may include the compiler's headers for the types it reads (the step plan, the modules'
# plans), never call into it: includes get this one extra allowance
READS_TYPES = {("runtime", "compiler")}


def layer_of(path):
    p = path.replace(os.sep, "/")
    if p in ("compiler/mdl.h",) or p.startswith("compiler/base/"):
        return "base"
    if p.startswith("runtime/kernels/") or p == "build/preludes.c":
        return "kernels"
    if p.startswith("compiler/driver/"):
        return "driver"
    if p.startswith("compiler/") or p.startswith("grammar/") or p in ("build/mdl.tab.c", "build/lex.yy.c",
                                                                      "build/mdl.tab.h"):
        return "compiler"
    if p.startswith("runtime/"):
        return "runtime"
    return None


def sources():
    out = []
    for top in ("compiler", "runtime", "grammar"):
        for d, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith((".c", ".h", ".cuh", ".l", ".y")):
                    out.append(os.path.relpath(os.path.join(d, f), ROOT))
    return sorted(out)


def check_includes(srcs, fails):
    by_name = {}
    for s in srcs:
        by_name.setdefault(os.path.basename(s), []).append(s)
    by_name.setdefault("mdl.tab.h", []).append("build/mdl.tab.h")
    for name, paths in by_name.items():
        if len(paths) > 1:
            fails.append("two headers named %s: %s" % (name, ", ".join(paths)))
    edges = {}
    for s in srcs:
        text = open(os.path.join(ROOT, s), errors="replace").read()
        for m in re.finditer(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            target = by_name.get(os.path.basename(m.group(1)))
            if not target:
                continue
            t = target[0]
            edges.setdefault(s, set()).add(t)
            a, b = layer_of(s), layer_of(t)
            if b != a and b not in USES[a] and (a, b) not in READS_TYPES:
                fails.append("%s (%s) includes %s (%s)" % (s, a, t, b))
    return edges


def symbols(obj):
    r = subprocess.run(["nm", obj], capture_output=True, text=True, check=True).stdout
    defined, undefined = set(), set()
    for line in r.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "U":
            undefined.add(parts[1])
        elif len(parts) == 3 and parts[1] in "TDBRGSVW":
            defined.add(parts[2])
    return defined, undefined


def check_calls(fails):
    objs = {}
    bdir = os.path.join(ROOT, BUILD)
    for d, _, files in os.walk(bdir):
        for f in files:
            if not f.endswith(".o"):
                continue
            rel = os.path.relpath(os.path.join(d, f), bdir)
            if rel.startswith(("tests", "tools", "fuzz", "asan")):  # (asan: sanitize.sh's copy of the sources)
                continue
            src = rel[:-2] + ".c"
            if not os.path.exists(os.path.join(ROOT, src)):
                src = "build/" + src
            if not os.path.exists(os.path.join(ROOT, src)):
                continue  # an object of a source that is gone
            objs[src] = os.path.join(d, f)
    if not objs:
        fails.append("no objects under %s: run make first" % BUILD)
        return {}
    owner, need = {}, {}
    for src, o in objs.items():
        defined, undefined = symbols(o)
        for s in defined:
            owner.setdefault(s, src)
        need[src] = undefined
    edges = {}
    for src, und in need.items():
        for s in sorted(und):
            t = owner.get(s)
            if not t or t == src or {src, t} == set(PARSER):
                continue
            edges.setdefault(src, {}).setdefault(t, []).append(s)
    for a, ts in sorted(edges.items()):
        for b, syms in sorted(ts.items()):
            la, lb = layer_of(a), layer_of(b)
            if lb != la and lb not in USES[la]:
                fails.append("%s (%s) calls %s (%s): %s" % (a, la, b, lb, " ".join(syms[:6])))
    return {a: set(ts) for a, ts in edges.items()}


def cycles(edges):
    # Tarjan's strongly connected components; a component of more than one node is a circle
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    nodes = set(edges) | {t for ts in edges.values() for t in ts}

    def visit(v):
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    advanced = True
                    break
                if w in on:
                    low[node] = min(low[node], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


FUNC_START = re.compile(r"^[A-Za-z_][\w \t\*,]*?\b(\w+)\s*\([^;]*$")


def check_sizes(srcs, fails):
    for s in srcs:
        if s.endswith((".l", ".y")):
            continue
        lines = open(os.path.join(ROOT, s), errors="replace").read().split("\n")
        if len(lines) - 1 > MAX_FILE_LINES:
            fails.append("%s has %d lines (at most %d)" % (s, len(lines) - 1, MAX_FILE_LINES))
        if not s.endswith(".c"):
            continue
        name, start = None, 0
        for i, line in enumerate(lines):
            if name is None:
                m = FUNC_START.match(line)
                if m and not line.startswith(("typedef", "struct", "enum", "static const", "#")) and \
                        m.group(1) not in ("if", "for", "while", "switch", "return", "sizeof"):
                    name, start = m.group(1), i
            elif line.startswith("}"):
                n = i - start + 1
                if n > MAX_FUNC_LINES and name not in LONG_OK:
                    fails.append("%s: %s() has %d lines (at most %d)" % (s, name, n, MAX_FUNC_LINES))
                name = None
            elif line.endswith(";") and not line.startswith((" ", "\t", "}")) and i == start + 1:
                name = None


def main():
    os.chdir(ROOT)
    srcs = sources()
    if "--list" in sys.argv:
        for s in srcs:
            print("%-10s %s" % (layer_of(s), s))
        return 0
    bad = 0
    fails = []
    inc = check_includes(srcs, fails)
    print(("[ok] " if not fails else "[fail] ") + "layers: includes run only down the layers" +
          "".join("\n  " + f for f in fails))
    bad += bool(fails)
    fails = []
    calls = check_calls(fails)
    print(("[ok] " if not fails else "[fail] ") + "layers: calls run only down the layers (runtime -> base, "
          "compiler -> base, driver -> all)" + "".join("\n  " + f for f in fails))
    bad += bool(fails)
    circ = cycles(calls)
    print(("[ok] " if not circ else "[fail] ") + "layers: no circle of calls between source files" +
          "".join("\n  " + " <-> ".join(c) for c in circ))
    bad += bool(circ)
    circ = cycles(inc)
    print(("[ok] " if not circ else "[fail] ") + "layers: no circle of includes" +
          "".join("\n  " + " <-> ".join(c) for c in circ))
    bad += bool(circ)
    fails = []
    check_sizes(srcs, fails)
    print(("[ok] " if not fails else "[fail] ") + "layers: no file over %d lines, no function over %d "
          "(the op switches %s aside)" % (MAX_FILE_LINES, MAX_FUNC_LINES, ", ".join(sorted(LONG_OK))) +
          "".join("\n  " + f for f in fails))
    bad += bool(fails)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
