#!/usr/bin/env bash
# The optimizers' reference numbers in tests/unit/test_interp.c (test_optimizers, test_muon) are what
# tests/torch/optim_ref.py prints: torch.optim.SGD and AdamW, and Lion's and Muon's published rules,
# recomputed here and compared with the pasted rows. Skips when /usr/bin/python3 cannot import torch.
set -u
cd "$(dirname "$0")/../.."
py=/usr/bin/python3
if ! why=$("$py" -c 'import torch' 2>&1); then
  echo "[skip] torch optimizers: $py cannot import torch: $(printf '%s\n' "$why" | tail -1)"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$py" tests/torch/optim_ref.py >"$tmp/ref" 2>"$tmp/err"; then
  echo "[fail] torch optimizers: optim_ref.py failed: $(tail -3 "$tmp/err" | tr '\n' ' ')"
  exit 1
fi
# Each printed row against the row of test_interp.c under the comment naming the same case, within 1e-12
# of the largest value (another PyTorch may sum in another order: the last digit or two differ).
"$py" - "$tmp/ref" tests/unit/test_interp.c <<'PY'
import re, sys
ref = [l for l in open(sys.argv[1]) if not l.startswith("//")]
src = open(sys.argv[2]).read()
rc = 0
for line in ref:
    nums, what = line.split("}, // ")
    what = what.strip()
    want = [float(x) for x in nums.strip().lstrip("{").split(",")]
    m = re.search(r"// " + re.escape(what) + r"\n\s*\{([^{}]*)\},", src)
    got = [float(x) for x in m.group(1).split(",")] if m else []
    ok = len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= 1e-12 * max(abs(b) for b in want)
    print("[%s] torch optimizers: %s: test_interp.c has PyTorch's numbers%s" % ("ok" if ok else "fail", what,
          "" if ok else " (it has %s, PyTorch gives %s)" % (got, want)))
    rc |= not ok
sys.exit(rc)
PY
