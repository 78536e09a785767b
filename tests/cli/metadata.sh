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

# Every metadata field out of range or of another form, for each verb that reads it: refused, status
# 1, one error naming the checkpoint and the field, nothing allocated for an absurd dim.
$m run models/gpt2-tiny.mdl "${small[@]}" --steps 2 --out "$tmp/r" >/dev/null 2>&1
setmeta() { python3 - "$@" <<'PY'
import json, struct, sys
f = open(sys.argv[1], 'rb')
header = json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))
data = f.read()
key, _, value = sys.argv[3].partition('=')
header['__metadata__'][key] = value
text = json.dumps(header).encode()
text += b' ' * (-len(text) % 8)
open(sys.argv[2], 'wb').write(struct.pack('<Q', len(text)) + text + data)
PY
}
bad=0 n=0
for kv in mdl.accumulate=99999999999 mdl.accumulate=0 mdl.accumulate=-4 mdl.accumulate=abc mdl.step=-5 \
  mdl.step=1e20 mdl.step=9007199254740993 mdl.step=12x mdl.seed=abc mdl.seed=-1 mdl.seed=18446744073709551616 \
  mdl.loader=1, mdl.loader=-1,0 mdl.loader=0,x mdl.shuffle=yes mdl.pack=1 mdl.optimizer=adam mdl.precision=fp16 \
  mdl.fp8_recorded=-2 mdl.source= mdl.model= mdl.dims=V=256,C mdl.dims=V=256,V=256 mdl.dims=V=0 \
  mdl.dims=V=256,maxT=2147483648; do
  key=${kv%%=*}
  mkdir -p "$tmp/x"
  setmeta "$tmp/r/checkpoint.safetensors" "$tmp/x/checkpoint.safetensors" "$kv"
  ck=$tmp/x/checkpoint.safetensors
  for verb in sample eval resume; do
    case $verb in
      sample) timeout 30 $m sample "$ck" --tokens 2 ;;
      eval) timeout 30 $m eval "$ck" --data "$tmp/data" --backend interp ;;
      resume) timeout 30 $m run models/gpt2-tiny.mdl "${small[@]}" --steps 3 --out "$tmp/x" --resume ;;
    esac >/dev/null 2>"$tmp/err"
    rc=$? n=$((n + 1))
    if [ $rc -ne 1 ] || [ "$(wc -l <"$tmp/err")" -ne 1 ] ||
      ! grep -q "^$ck: error: bad checkpoint metadata: $key = " "$tmp/err"; then
      fail "$verb with $kv: status $rc, $(head -c 300 "$tmp/err")"
      bad=$((bad + 1))
    fi
  done
done
[ $bad -eq 0 ] && ok "$n bad metadata values (25 fields and forms, sample, eval and --resume): each refused naming the checkpoint and the field"

# maxT = 1e8 (a whole number, in range): the parameters' shapes are the checkpoint's before any is
# allocated (sample allocated 51 GB for wpe), so each verb refuses it at once under a 2 GB limit.
setmeta "$tmp/r/checkpoint.safetensors" "$tmp/x/checkpoint.safetensors" mdl.dims=V=256,maxT=100000000,C=64,H=4,D=16,L=2,B=2,T=16
for verb in sample eval; do
  if [ $verb = sample ]; then (ulimit -v 2000000; $m sample "$ck" --tokens 2); else
    (ulimit -v 2000000; $m eval "$ck" --data "$tmp/data" --backend interp); fi >/dev/null 2>"$tmp/err"
  rc=$?
  if [ $rc -eq 1 ] && grep -q "^$ck: error: checkpoint does not match .*gpt2-tiny.mdl: tensor 'wpe' is \[128,64\], the model wants \[100000000,64\]" "$tmp/err"; then
    ok "$verb: mdl.dims with maxT = 1e8 is refused by wpe's shape, before anything is allocated"
  else
    fail "$verb with maxT = 1e8: status $rc, $(head -c 300 "$tmp/err")"
  fi
done
