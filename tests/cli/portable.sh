#!/usr/bin/env bash
# Portable checkpoints and sampling past the context. A checkpoint stores its .mdl text and its
# tokenizer (mdl.source_text, mdl.tokenizer_base64): moved away from its model and data, it samples
# the same text and resumes to the losses of an uninterrupted run; a model file that differs from
# the stored one gets a warning (sample, and --resume when the parameters match) or a refusal
# (--resume when they do not); a checkpoint without the stored copies (as older ones were) samples
# from the files it names. Sampling goes past the context (maxT) with the context cropped to its
# last maxT tokens, as nanoGPT does, and crops a long prompt the same way, each with one note.
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ok() { echo "[ok] portable: $1"; }
fail() { echo "[fail] portable: $1"; }

mkdir -p "$tmp/corpus"
for i in $(seq 1 12); do head -c $((2500 * i)) /usr/share/common-licenses/GPL-3 | tail -c 2500 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null || fail "prep"
cp models/gpt2-tiny.mdl "$tmp/model.mdl"
common=(-D B=2 -D T=32 --val-every 0 --shuffle --backend interp)
losses() { sed -n 's/.*"step":\([0-9]*\),"loss":\([0-9.]*\).*/\1 \2/p' "$1/log.jsonl"; }
sample() { $m sample "$1" --prompt "the" --tokens 40 --seed 3 --top-k 5 "${@:2}"; }

$m run "$tmp/model.mdl" "${common[@]}" --data "$tmp/data" --steps 10 --out "$tmp/a" >/dev/null 2>&1
$m run "$tmp/model.mdl" "${common[@]}" --data "$tmp/data" --steps 4 --out "$tmp/b" >/dev/null 2>&1
if python3 - "$tmp/b/checkpoint.safetensors" "$tmp/model.mdl" "$tmp/data/tokenizer.bin" <<'EOF'; then
import base64, json, struct, sys
f = open(sys.argv[1], 'rb')
meta = json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))['__metadata__']
assert meta['mdl.source_text'] == open(sys.argv[2]).read()
assert base64.b64decode(meta['mdl.tokenizer_base64']) == open(sys.argv[3], 'rb').read()
EOF
  ok "the checkpoint stores the .mdl text and tokenizer.bin, read back by Python's json and base64"
else
  fail "the checkpoint's stored copies are not the files"
fi
sample "$tmp/b/checkpoint.safetensors" >"$tmp/before.txt" 2>"$tmp/before.err"

# An old-style checkpoint: the same file less the two stored copies.
python3 - "$tmp/b/checkpoint.safetensors" "$tmp/old.safetensors" <<'EOF'
import json, struct, sys
f = open(sys.argv[1], 'rb')
header = json.loads(f.read(struct.unpack('<Q', f.read(8))[0]))
data = f.read()
for key in ('mdl.source_text', 'mdl.tokenizer_base64'):
    del header['__metadata__'][key]
text = json.dumps(header).encode()
text += b' ' * (-len(text) % 8)
open(sys.argv[2], 'wb').write(struct.pack('<Q', len(text)) + text + data)
EOF
if sample "$tmp/old.safetensors" >"$tmp/old.txt" 2>"$tmp/old.err" && cmp -s "$tmp/old.txt" "$tmp/before.txt" &&
  [ ! -s "$tmp/old.err" ] && [ "$(wc -c <"$tmp/before.txt")" -gt 10 ]; then
  ok "a checkpoint without the stored copies samples from the files it names, as before"
else
  fail "old-style checkpoint: $(head -c 300 "$tmp/old.err")"
fi

# Move the run away; the data go elsewhere (without their tokenizer), the model file goes.
mkdir "$tmp/far"
mv "$tmp/b" "$tmp/far/b"
mv "$tmp/data" "$tmp/far/data"
rm "$tmp/model.mdl" "$tmp/far/data/tokenizer.bin"
if sample "$tmp/far/b/checkpoint.safetensors" >"$tmp/after.txt" 2>"$tmp/after.err" &&
  cmp -s "$tmp/after.txt" "$tmp/before.txt" && [ ! -s "$tmp/after.err" ]; then
  ok "moved away from its model and data, the checkpoint samples the same text (same seed)"
else
  fail "moved checkpoint: $(head -c 300 "$tmp/after.err")"
fi
if ! sample "$tmp/old.safetensors" >/dev/null 2>"$tmp/old.err" &&
  grep -q "error: cannot read the checkpoint's model $tmp/model.mdl" "$tmp/old.err"; then
  ok "the old-style checkpoint, its model gone, says which file it needs"
else
  fail "old-style checkpoint without its model: $(head -c 300 "$tmp/old.err")"
fi

# A model file at the recorded path that differs: sampling says so once and uses the stored copy.
(cat models/gpt2-tiny.mdl; echo "# a comment") >"$tmp/model.mdl"
if sample "$tmp/far/b/checkpoint.safetensors" >"$tmp/changed.txt" 2>"$tmp/changed.err" &&
  cmp -s "$tmp/changed.txt" "$tmp/before.txt" && [ "$(wc -l <"$tmp/changed.err")" -eq 1 ] &&
  grep -q "warning: $tmp/model.mdl differs from the model this checkpoint was trained with; sampling with the copy of that model stored in the checkpoint" "$tmp/changed.err"; then
  ok "sample: a model file that differs from the stored one gets one warning; the stored one samples"
else
  fail "sample with a changed model file: $(head -c 300 "$tmp/changed.err")"
fi

# --resume elsewhere: the model given decides; the stored tokenizer stands in for the data's.
cp -r "$tmp/far/b" "$tmp/far/b2"
cp -r "$tmp/far/b" "$tmp/far/b3"
$m run models/gpt2-tiny.mdl "${common[@]}" --data "$tmp/far/data" --steps 10 --out "$tmp/far/b" --resume \
  >"$tmp/resumed" 2>&1
if grep -q "resumed from" "$tmp/resumed" && ! grep -q "warning" "$tmp/resumed" &&
  [ "$(losses "$tmp/a" | wc -l)" -eq 10 ] && diff <(losses "$tmp/a") <(losses "$tmp/far/b") >"$tmp/d"; then
  ok "moved, its data elsewhere without tokenizer.bin: 4 steps + resume to 10 give the uninterrupted losses"
else
  fail "moved resume: $(head -c 300 "$tmp/d") $(grep -i 'error\|warning' "$tmp/resumed" | head -c 300)"
fi
$m run "$tmp/model.mdl" "${common[@]}" --data "$tmp/far/data" --steps 5 --out "$tmp/far/b2" --resume \
  >"$tmp/resumed2" 2>&1
rc=$?
if [ $rc -eq 0 ] && [ "$(grep -c warning "$tmp/resumed2")" -eq 1 ] &&
  grep -q "warning: $tmp/model.mdl differs from the model this checkpoint was trained with (stored in it); resuming with $tmp/model.mdl, whose parameters have the same names and shapes" "$tmp/resumed2"; then
  ok "--resume with a model whose text differs but whose parameters match: one warning, and it resumes"
else
  fail "--resume with a changed model: status $rc, $(grep -i 'error\|warning' "$tmp/resumed2" | head -c 300)"
fi
sed 's/ln1_w/ln1_weight/g' models/gpt2-tiny.mdl >"$tmp/renamed.mdl"
$m run "$tmp/renamed.mdl" "${common[@]}" --data "$tmp/far/data" --steps 5 --out "$tmp/far/b3" --resume \
  >"$tmp/refused" 2>&1
rc=$?
if [ $rc -eq 1 ] && grep -q "error: $tmp/renamed.mdl differs from the model this checkpoint was trained with (stored in it), and so do its parameters: no tensor 'h.0.ln1_weight'" "$tmp/refused"; then
  ok "--resume with a model whose parameters differ from the stored one's is refused, saying why"
else
  fail "--resume with renamed parameters: status $rc, $(grep -i error "$tmp/refused" | head -c 300)"
fi
# (data whose tokenizer has 300 tokens: the warning, then the refusal of a tokenizer larger than V)
cp -r "$tmp/far/data" "$tmp/far/data300"
$m prep "$tmp/corpus" -o "$tmp/other" --vocab 300 >/dev/null 2>&1
cp "$tmp/other/tokenizer.bin" "$tmp/far/data300/tokenizer.bin"
$m run models/gpt2-tiny.mdl "${common[@]}" --data "$tmp/far/data300" --steps 6 --out "$tmp/far/b3" --resume \
  >"$tmp/tok" 2>&1
if grep -q "warning: $tmp/far/data300/tokenizer.bin differs from the tokenizer this checkpoint was trained with (stored in it); resuming with $tmp/far/data300/tokenizer.bin" "$tmp/tok"; then
  ok "--resume on data whose tokenizer differs from the stored one says so"
else
  fail "--resume with another tokenizer: $(grep -i 'error\|warning' "$tmp/tok" | head -c 300)"
fi

# Past the context: maxT = 16, 50 tokens greedy (byte-level tokens: one byte each).
$m prep "$tmp/corpus" -o "$tmp/bytes" >/dev/null 2>&1
$m run models/gpt2-tiny.mdl -D B=4 -D T=16 -D maxT=16 --data "$tmp/bytes" --val-every 0 --steps 30 \
  --backend interp --out "$tmp/c" >/dev/null 2>&1
note="note: the model's context of 16 tokens is full: each further token is drawn from the last 16, fed again from position 0 (the context slides)"
$m sample "$tmp/c/checkpoint.safetensors" --prompt "the" --tokens 50 --temperature 0 >"$tmp/long.txt" 2>"$tmp/long.err"
if [ "$(wc -c <"$tmp/long.txt")" -eq $((3 + 50 + 1)) ] && [ "$(wc -l <"$tmp/long.err")" -eq 1 ] &&
  grep -q "$note" "$tmp/long.err"; then
  ok "--tokens 50 past a context of 16 gives 50 tokens, with one note"
else
  fail "past the context: $(wc -c <"$tmp/long.txt") bytes out, stderr $(head -c 300 "$tmp/long.err")"
fi
prompt="the General Public License is a free, copyleft license"
note="note: the prompt is 55 tokens with its leading EOS, more than the model's context of 16: the model sees the last 16 tokens, before and after each new one"
$m sample "$tmp/c/checkpoint.safetensors" --prompt "$prompt" --tokens 20 --temperature 0 >"$tmp/crop.txt" 2>"$tmp/crop.err"
if [ "$(wc -c <"$tmp/crop.txt")" -eq $((${#prompt} + 20 + 1)) ] && [ "$(wc -l <"$tmp/crop.err")" -eq 1 ] &&
  grep -q "$note" "$tmp/crop.err"; then
  ok "a prompt of 55 tokens is cropped to the context's 16, with one note"
else
  fail "a long prompt: $(wc -c <"$tmp/crop.txt") bytes out, stderr $(head -c 300 "$tmp/crop.err")"
fi
