#!/usr/bin/env bash
# Crafted files against every reader: a FIFO (which blocks a reader that opens it plainly), a link
# to /dev/zero (which never ends) and a folder, in the place of a model, a checkpoint, an .npy, an
# .npz, a token shard, a tokenizer, prep's source.txt, prep's input and a resumed run's log; a
# checkpoint whose metadata names a FIFO as its tokenizer or model while it stores both; one with
# 200k metadata keys. Each is refused at once with the path and the reason, or read at once where
# the checkpoint holds what is needed; none may hang (each command runs under a 20 s timeout, and
# takes well under a second).
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] crafted: $1"; }
fail() { echo "[fail] crafted: $1"; }
# run NAME CMD...: CMD under a timeout, its status in $rc, its stderr in $tmp/err
run() { timeout 20 "$@" >"$tmp/out" 2>"$tmp/err" </dev/null; rc=$?; }
# refused NAME PATH: the last command failed with status 1 (not the timeout's 124), naming PATH and why
refused() {
  if [ "$rc" -eq 1 ] && grep -qF "$2: error: not a regular file ($3)" "$tmp/err"; then ok "$1"
  else fail "$1: status $rc: $(head -c 300 "$tmp/err")"; fi
}
# crafted DIR NAME: DIR/NAME as each kind in turn, calling the function `try` with the kind's words
crafted() {
  local kind
  for kind in fifo zero dir; do
    rm -rf "${1:?}/$2"
    case $kind in
      fifo) mkfifo "$1/$2"; try "a FIFO" "a FIFO" ;;
      zero) ln -s /dev/zero "$1/$2"; try "a link to /dev/zero" "a character device, such as /dev/zero" ;;
      dir) mkdir "$1/$2"; try "a folder" "a folder" ;;
    esac
  done
}

mkdir -p "$tmp/corpus" "$tmp/c"
for i in 1 2 3 4; do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
small=(-D B=2 -D T=16 --val-every 0 --backend cpu)
$m run models/gpt2-tiny.mdl "${small[@]}" --data "$tmp/data" --steps 1 --out "$tmp/run" >/dev/null 2>&1 || fail "the run"
ckpt=$tmp/run/checkpoint.safetensors
build/tools/blobs "$tmp/blobs" 64 >/dev/null || fail "build/tools/blobs"

# a copy of the checkpoint $1 as $2 with metadata keys added: N of filler ("x.0000001": "v"), then
# KEY=VALUE set, or +KEY=VALUE written a second time at the start
meta() {
  python3 - "$@" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
meta, twice = h["__metadata__"], ""
for i in range(int(sys.argv[3])):
    meta["x.%07d" % i] = "v"
for kv in sys.argv[4:]:
    k, v = kv.split("=", 1)
    if k[0] == "+": twice += json.dumps(k[1:]) + ":" + json.dumps(v) + ","
    else: meta[k] = v
t = json.dumps(h, separators=(",", ":")).replace('"__metadata__":{', '"__metadata__":{' + twice, 1).encode()
t += b" " * (-len(t) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(t)) + t + b[8 + n:])
PY
}

try() { run $m run "$tmp/c/m.mdl" --steps 1 --out "$tmp/o"; refused "a model that is $1" "$tmp/c/m.mdl" "$2"; }
crafted "$tmp/c" m.mdl
try() { run $m sample "$tmp/c/ck.safetensors" --tokens 1; refused "a checkpoint that is $1" "$tmp/c/ck.safetensors" "$2"; }
crafted "$tmp/c" ck.safetensors
cp -r "$tmp/blobs" "$tmp/npy"
try() { run $m run models/mlp.mdl --data "$tmp/npy" --steps 1 --backend cpu --out "$tmp/o"
        refused "an .npy that is $1" "$tmp/npy/x.npy" "$2"; }
crafted "$tmp/npy" x.npy
mkdir "$tmp/npz"
try() { run $m run models/mlp.mdl --data "$tmp/npz" --steps 1 --backend cpu --out "$tmp/o"
        refused "an .npz that is $1" "$tmp/npz/set.npz" "$2"; }
crafted "$tmp/npz" set.npz
cp -r "$tmp/data" "$tmp/shards"
try() { run $m run models/gpt2-tiny.mdl "${small[@]}" --data "$tmp/shards" --steps 1 --out "$tmp/o"
        refused "a token shard that is $1" "$tmp/shards/train_000000.bin" "$2"; }
crafted "$tmp/shards" train_000000.bin
cp -r "$tmp/data" "$tmp/tok"
try() { run $m run models/gpt2-tiny.mdl "${small[@]}" --data "$tmp/tok" --steps 1 --out "$tmp/o"
        refused "a tokenizer that is $1" "$tmp/tok/tokenizer.bin" "$2"; }
crafted "$tmp/tok" tokenizer.bin
cp -r "$tmp/data" "$tmp/src"
try() { run $m run models/gpt2-tiny.mdl "${small[@]}" --data "$tmp/src" --tokenize-on-the-fly --steps 1 --out "$tmp/o"
        refused "prep's source.txt that is $1" "$tmp/src/source.txt" "$2"; }
crafted "$tmp/src" source.txt
cp -r "$tmp/run" "$tmp/res"
try() { run $m run models/gpt2-tiny.mdl "${small[@]}" --data "$tmp/data" --steps 2 --resume --out "$tmp/res"
        refused "a resumed run's log.jsonl that is $1" "$tmp/res/log.jsonl" "$2"; }
crafted "$tmp/res" log.jsonl
mkfifo "$tmp/c/in.fifo"
run $m prep "$tmp/c/in.fifo" -o "$tmp/o"
if [ "$rc" -eq 1 ] && grep -q "in.fifo: error: not a regular file or a folder" "$tmp/err"; then ok "prep's input that is a FIFO"
else fail "prep's input that is a FIFO: status $rc: $(head -c 300 "$tmp/err")"; fi

# The tokenizer and the model a checkpoint records are only compared with the copies it stores:
# a FIFO, /dev/zero or a folder there is not read, and sampling goes on from the stored copies.
ln -sf /dev/zero "$tmp/c/zero"
for where in "$tmp/c/in.fifo" "$tmp/c/zero" "$tmp/c"; do
  for key in mdl.tokenizer mdl.source; do
    meta "$ckpt" "$tmp/c/k.safetensors" 0 "$key=$where"
    run $m sample "$tmp/c/k.safetensors" --tokens 2 --prompt The --backend cpu
    if [ "$rc" -eq 0 ] && grep -q '^The' "$tmp/out"; then ok "a checkpoint whose $key is ${where##*/} samples from its own copy"
    else fail "a checkpoint whose $key is ${where##*/}: status $rc: $(head -c 300 "$tmp/err")"; fi
  done
done

# 200k metadata keys (6 MB of header): read in linear time, so sampling starts at once (the duplicate
# check once compared every key with all before it: minutes).
meta "$ckpt" "$tmp/c/keys.safetensors" 200000
run $m sample "$tmp/c/keys.safetensors" --tokens 2 --prompt The --backend cpu
if [ "$rc" -eq 0 ] && grep -q '^The' "$tmp/out"; then ok "a checkpoint with 200k metadata keys samples"
else fail "a checkpoint with 200k metadata keys: status $rc: $(head -c 300 "$tmp/err")"; fi
meta "$ckpt" "$tmp/c/keys.safetensors" 200000 +x.0199999=w
run $m sample "$tmp/c/keys.safetensors" --tokens 2 --prompt The --backend cpu
if [ "$rc" -eq 1 ] && grep -q "keys.safetensors: error: duplicate key 'x.0199999' in the header" "$tmp/err"; then
  ok "... and one of them twice is refused, naming it"
else fail "200k metadata keys, one twice: status $rc: $(head -c 300 "$tmp/err")"; fi
