#!/usr/bin/env bash
# What a run writes about itself, and what a checkpoint's metadata may hold. Names of any length go
# whole into OUT/run.json and mdl.dims; every metadata field of a checkpoint is parsed strictly and
# range-checked by --resume, eval and sample, a bad one refused with the checkpoint's path and the field.
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] metadata: $1"; }
fail() { echo "[fail] metadata: $1"; }

mkdir -p "$tmp/corpus"
for i in 1 2 3 4 5 6; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
small=(-D B=2 -D T=16 --val-every 0 --backend interp --data "$tmp/data")

# A model name of 3000 characters and dims of 300 (run.json was formatted into 2 KB, mdl.dims into
# 48 bytes a dim): both files hold them whole, read back by Python's json.
name=$(printf 'n%.0s' $(seq 3000)) c=$(printf 'c%.0s' $(seq 300))
sed -e "s/^model gpt2_tiny/model $name/" -e "s/\bC\b/$c/g" -e "s/\bH\b/h$c/g" -e "s/\bL\b/l$c/g" \
  models/gpt2-tiny.mdl >"$tmp/long.mdl"
$m run "$tmp/long.mdl" "${small[@]}" --steps 1 --out "$tmp/long" >/dev/null 2>"$tmp/err"
if python3 - "$tmp/long" "$name" "$c" <<'PY' 2>>"$tmp/err"; then
import json, struct, sys
out, name, c = sys.argv[1:]
run = json.load(open(out + '/run.json'))
assert run['model'] == name, 'run.json model: %d characters' % len(run['model'])
assert run['checkpoint'].startswith('checkpoint ')
f = open(out + '/checkpoint.safetensors', 'rb')
meta = json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))['__metadata__']
want = 'V=256,maxT=128,%s=64,h%s=4,D=16,l%s=2,B=2,T=16' % (c, c, c)
assert meta['mdl.dims'] == want, 'mdl.dims: %r' % meta['mdl.dims'][:200]
assert meta['mdl.model'] == name
PY
  ok "a 3000-character model name and 300-character dims go whole into run.json and mdl.dims"
else
  fail "long names: $(tail -c 300 "$tmp/err")"
fi
