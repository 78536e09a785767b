#!/usr/bin/env bash
# What `mdlc run` and `mdlc sample` do when things go wrong: a model larger than the memory, a loss
# or gradient that stops being finite, two runs into one folder, a log left by another run, a
# sample without a prompt, Ctrl-C while the C compiler runs, a disk that takes no more bytes.
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
pid=
trap '[ -n "$pid" ] && kill -9 $pid 2>/dev/null; rm -rf "$tmp"' EXIT
ok() { echo "[ok] hardening: $1"; }
fail() { echo "[fail] hardening: $1"; }
check() { if eval "$2"; then ok "$1"; else fail "$1: $(tail -c 400 "$tmp/err" 2>/dev/null)"; fi; }

mkdir -p "$tmp/corpus"
for i in $(seq 1 8); do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null || fail "prep"
small=(-D B=2 -D T=16 --data "$tmp/data" --val-every 0 --backend cpu)
# the first non-finite value of a checkpoint's tensors, as "name", or "" when all are finite
nonfinite() {
  [ -f "$1" ] || { echo "(no file $1)"; return; }
  python3 -c 'import json, math, struct, sys
b = open(sys.argv[1], "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
for k, t in h.items():
    if k == "__metadata__": continue
    lo, hi = t["data_offsets"]
    if any(not math.isfinite(x) for x in struct.unpack("<%df" % ((hi - lo) // 4), b[8 + n + lo:8 + n + hi])):
        print(k); break' "$1"
}
# a copy of a safetensors file with element 3 of tensor NAME set to NaN
poison() {
  python3 -c 'import json, struct, sys
b = bytearray(open(sys.argv[1], "rb").read()); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
o = 8 + n + h[sys.argv[2]]["data_offsets"][0] + 12
b[o:o + 4] = struct.pack("<f", float("nan")); open(sys.argv[3], "wb").write(b)' "$@"
}
ckpt_step() { grep -ao '"mdl.step":"[0-9]*"' "$1" | grep -o '[0-9]*'; }

# 1. Parameters that cannot fit: refused before anything is compiled or allocated, saying how much
# the model needs and how much memory there is (a mapping larger than the memory would be granted,
# and the run killed, or crash, later). (V=4e9 with C=1e5, the issue's case, is now refused by the
# front end's limit of 2^36 elements a tensor; 6e7 x 1000 passes it and needs about 960 GB.)
$m run models/gpt2-tiny.mdl -D V=60000000 -D C=1000 "${small[@]}" --steps 1 --out "$tmp/big" >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a model larger than the memory is refused with status 1" "[ $rc -eq 1 ]"
check "... saying what it needs and what there is" \
  "grep -q 'does not fit in memory: its step needs [0-9.]* GB .*, this machine has [0-9.]* GB available' '$tmp/err'"
check "... before compiling anything or creating its folder" "! grep -q 'cc took' '$tmp/out' && [ ! -e '$tmp/big' ]"

# 2. A learning rate of 1e6: the first step whose gradient norm (or loss) is not finite stops the
# run, names the tensor, leaves the weights as they were and writes them: every tensor of the
# checkpoint finite, at the step before; sampling from it works.
sed 's/lr=2e-3/lr=1e6/; s/warmup=100/warmup=1/' models/gpt2-tiny.mdl >"$tmp/hot.mdl"
$m run "$tmp/hot.mdl" "${small[@]}" --steps 8 --out "$tmp/hot" >"$tmp/out" 2>"$tmp/err"
rc=$?
bad=$(sed -n 's/.*error: step \([0-9]*\): .*/\1/p' "$tmp/err")
check "a non-finite step stops the run with status 1, naming the step" "[ $rc -eq 1 ] && [ -n '$bad' ]"
check "... and the tensor" "grep -q 'step $bad: the \(gradient of [a-z0-9_.]* is\|loss (loss) is\) ' '$tmp/err'"
check "... stopping with the last finite weights, written" \
  "grep -q 'stopping with the weights of step $((bad - 1)), which it did not change: wrote them to' '$tmp/err' &&
   [ '$(ckpt_step "$tmp/hot/checkpoint.safetensors")' = $((bad - 1)) ]"
check "every tensor of the checkpoint is finite" "[ -z '$(nonfinite "$tmp/hot/checkpoint.safetensors")' ]"
check "the log ends at the step that stopped" "tail -1 '$tmp/hot/log.jsonl' | grep -q '\"step\":$bad,'"
$m sample "$tmp/hot/checkpoint.safetensors" --tokens 4 --prompt "The" >"$tmp/out" 2>"$tmp/err"
check "the checkpoint of the last finite weights samples" "[ $? -eq 0 ]"
# the reference interpreter (fp32 where the CPU's GEMMs may be bf16: its own step) leaves the
# weights as they were too
$m run "$tmp/hot.mdl" "${small[@]}" --steps 8 --out "$tmp/hoti" --backend interp >/dev/null 2>"$tmp/err"
ibad=$(sed -n 's/.*error: step \([0-9]*\): .*/\1/p' "$tmp/err")
check "the interpreter stops too, with the last finite weights" "[ -n '$ibad' ] &&
  [ \"\$(ckpt_step '$tmp/hoti/checkpoint.safetensors')\" = \$(($ibad - 1)) ] &&
  [ -z \"\$(nonfinite '$tmp/hoti/checkpoint.safetensors')\" ]"
# --skip-nonfinite N: a warning per skipped step, the run goes on, its checkpoint finite
$m run "$tmp/hot.mdl" "${small[@]}" --steps 6 --skip-nonfinite 100 --out "$tmp/skip" >"$tmp/out" 2>"$tmp/err"
rc=$?
nskip=$(grep -c 'warning: step [0-9]*: .*: the step is skipped, the weights are not updated' "$tmp/err")
check "--skip-nonfinite skips such steps with a warning each" "[ $rc -eq 0 ] && [ $nskip -ge 1 ]"
check "... and the weights it keeps are finite" "[ -z '$(nonfinite "$tmp/skip/checkpoint.safetensors")' ]"
$m run "$tmp/hot.mdl" "${small[@]}" --steps 8 --skip-nonfinite 1 --out "$tmp/skip1" >/dev/null 2>"$tmp/err"
check "--skip-nonfinite 1 skips one, then stops" \
  "[ \$(grep -c 'the step is skipped' '$tmp/err') = 1 ] && grep -q 'error: step [0-9]*: .*stopping' '$tmp/err'"
# non-finite weights from the start: the loss of step 1 is NaN; no checkpoint is claimed
$m init models/gpt2-tiny.mdl -o "$tmp/w.safetensors" >/dev/null
poison "$tmp/w.safetensors" wte "$tmp/wnan.safetensors"
$m run models/gpt2-tiny.mdl "${small[@]}" --steps 3 --weights "$tmp/wnan.safetensors" --out "$tmp/nan1" \
  >/dev/null 2>"$tmp/err"
check "a NaN loss at the first step: named, and no checkpoint claimed" \
  "grep -q 'step 1: the loss (loss) is nan; .*no checkpoint was written' '$tmp/err' && ! grep -q 'is kept' '$tmp/err' &&
   [ ! -e '$tmp/nan1/checkpoint.safetensors' ]"
# a checkpoint with a NaN in it: refused by sample and by --resume, the tensor named
poison "$tmp/hot/checkpoint.safetensors" h.1.fc_w "$tmp/poisoned.safetensors"
$m sample "$tmp/poisoned.safetensors" --prompt "The" >/dev/null 2>"$tmp/err"
check "sample refuses a checkpoint with a NaN, naming the tensor" \
  "[ $? -eq 1 ] && grep -q \"error: parameter 'h.1.fc_w' is not finite\" '$tmp/err'"
cp "$tmp/poisoned.safetensors" "$tmp/hot/checkpoint.safetensors"
$m run "$tmp/hot.mdl" "${small[@]}" --steps 8 --out "$tmp/hot" --resume >/dev/null 2>"$tmp/err"
check "--resume refuses a checkpoint with a NaN, naming the tensor" \
  "[ $? -eq 1 ] && grep -q \"tensor 'h.1.fc_w' is not finite\" '$tmp/err'"

# 4. Two runs into one folder: the second stops at once, naming the folder and the first's pid.
$m run models/gpt2-tiny.mdl "${small[@]}" --steps 100000 --ckpt-every 100000 --out "$tmp/busy" >/dev/null 2>&1 &
pid=$!
while [ ! -s "$tmp/busy/log.jsonl" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
$m run models/gpt2-tiny.mdl "${small[@]}" --steps 3 --out "$tmp/busy" --resume >"$tmp/out" 2>"$tmp/err"
rc=$?
check "a second run into a folder in use is refused, naming it and the other run's pid" \
  "[ $rc -eq 1 ] && grep -q '$tmp/busy: error: another run (pid $pid) is writing into this folder' '$tmp/err'"
kill -TERM $pid
wait $pid
pid=
check "... and the first run is left to finish" "[ -s '$tmp/busy/checkpoint.safetensors' ]"
mkdir -p "$tmp/logonly"
echo '{"step":1,"loss":5.0}' >"$tmp/logonly/log.jsonl"
$m run models/gpt2-tiny.mdl "${small[@]}" --steps 2 --out "$tmp/logonly" >/dev/null 2>"$tmp/err"
check "a folder holding another run's log (and no checkpoint) is refused" \
  "[ $? -eq 1 ] && grep -q 'log.jsonl: error: the log of another run is already here' '$tmp/err' &&
   [ \"\$(cat '$tmp/logonly/log.jsonl')\" = '{\"step\":1,\"loss\":5.0}' ]"

# 5. No --prompt: generation starts from EOS.
$m sample "$tmp/skip/checkpoint.safetensors" --tokens 5 >"$tmp/out" 2>"$tmp/err"
check "sample without --prompt generates (status 0)" "[ $? -eq 0 ]"

# 6. Ctrl-C while the C compiler runs (a stand-in compiler that writes its output and waits): the
# compiler's temporary file does not stay in the module cache.
mkdir -p "$tmp/fakecc" "$tmp/cc-cache"
cat >"$tmp/fakecc/cc" <<'EOF'
#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
echo partial >"$out"
exec sleep 3600
EOF
chmod +x "$tmp/fakecc/cc"
with_sigint='import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])'
PATH="$tmp/fakecc:$PATH" MDL_CACHE="$tmp/cc-cache" setsid python3 -c "$with_sigint" $m run models/gpt2-tiny.mdl \
  "${small[@]}" --steps 1 --out "$tmp/ccint" >/dev/null 2>&1 &
pid=$!
while ! ls "$tmp/cc-cache" | grep -q '\.so\.tmp\.' && kill -0 $pid 2>/dev/null; do sleep 0.1; done
ls "$tmp/cc-cache" | grep -q '\.so\.tmp\.' || fail "the stand-in compiler never ran"
kill -INT -- -$pid # (the terminal's Ctrl-C: the whole process group)
wait $pid
rc=$?
pid=
check "Ctrl-C during the compile stops the run as SIGINT" "[ $rc -eq 130 ]"
check "... and leaves no temporary module in the cache" "! ls '$tmp/cc-cache' | grep -q '\.tmp'"

# A disk that takes no more bytes (RLIMIT_FSIZE 0: every write fails with EFBIG, as ENOSPC would):
# the log's write failure is reported, not only the checkpoint's. (The module is compiled first.)
$m run models/gpt2-tiny.mdl "${small[@]}" --steps 2 --out "$tmp/warm" >/dev/null 2>&1
no_bytes='import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)); os.execvp(sys.argv[1], sys.argv[1:])'
# (stderr through a pipe: the limit holds for every regular file the run writes, a redirection too)
python3 -c "$no_bytes" $m run models/gpt2-tiny.mdl "${small[@]}" --steps 2 --out "$tmp/full" 2>&1 >/dev/null |
  cat >"$tmp/err"
rc=${PIPESTATUS[0]}
check "a full disk: status 1" "[ $rc -eq 1 ]"
check "... the log's write failure is reported" "grep -q 'log.jsonl: error: cannot write the log at step 1: File too large' '$tmp/err'"
check "... and the checkpoint's" "grep -q 'checkpoint.safetensors.*error' '$tmp/err'"
