#!/usr/bin/env bash
# `mdlc run --tokenize-on-the-fly`: training batches tokenised from the text prep recorded give the
# losses the shards give, bit for bit (packed, padded, padded and shuffled; learned merges; resumed
# from either's checkpoint). Then the errors: an input changed, moved or unreadable since prep, a
# data folder without source.txt, shuffled packed rows: an exit status, the path and the reason, and
# nothing in --out lost.
set -u
cd "$(dirname "$0")/../.."
m=bin/mdlc
tmp=$(mktemp -d)
trap 'chmod -R u+rwX "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
ok() { echo "[ok] onthefly: $1"; }
fail() { echo "[fail] onthefly: $1"; }

expect() { # expect NAME STATUS ARGS...: mdlc run ARGS exits with STATUS
  local name=$1 want=$2; shift 2
  $m run "$@" >"$tmp/out" 2>"$tmp/err"; local rc=$?
  if [ "$rc" -eq "$want" ]; then ok "$name"; else fail "$name: status $rc, wanted $want: $(head -c 300 "$tmp/err")"; fi
}
contains() { # contains NAME FILE TEXT
  if grep -qF -- "$3" "$2"; then ok "$1"; else fail "$1: '$3' not in: $(head -c 400 "$2")"; fi
}
# The log without the timings: step, loss, lr, grad_norm and val_loss, as printed.
figures() { sed -E 's/,"ms":[^,]*,"tok_s":[^,]*,"mfu":[^,}]*//' "$1/log.jsonl"; }
same_figures() { # same_figures NAME DIR1 DIR2 [STEPS]
  local n
  n=$(figures "$2" | wc -l)
  if [ "$n" -eq "${4:-4}" ] && diff <(figures "$2") <(figures "$3") >"$tmp/diff"; then ok "$1"; else
    fail "$1: $n steps logged; $(head -c 400 "$tmp/diff")"; fi
}

# Short documents (a packed row of 32 crosses several) in a folder, a BPE vocabulary.
mkdir -p "$tmp/corpus/more"
for i in $(seq 1 16); do
  head -c $((700 * i)) /usr/share/common-licenses/GPL-3 | tail -c $((150 + 40 * i)) >"$tmp/corpus/d$i.txt"
done
mv "$tmp"/corpus/d1[0-9].txt "$tmp/corpus/more/"
$m prep "$tmp/corpus" -o "$tmp/data" --vocab 300 --val-fraction 0.2 --shard-tokens 500 >/dev/null 2>&1 ||
  fail "prep"
run0=(models/gpt2-tiny.mdl --backend cpu --steps 4 -D B=2 -D T=32 -D V=300 --data "$tmp/data" --val-every 2)
run=("${run0[@]}" --no-shuffle) # (the last of --shuffle and --no-shuffle counts)

i=0
for mode in "" "--no-pack" "--no-pack --shuffle"; do
  i=$((i + 1))
  # shellcheck disable=SC2086
  expect "shards${mode:+ $mode}: trains" 0 "${run[@]}" $mode --out "$tmp/a$i"
  # shellcheck disable=SC2086
  expect "text${mode:+ $mode}: trains" 0 "${run[@]}" $mode --out "$tmp/b$i" --tokenize-on-the-fly
  contains "text${mode:+ $mode}: the run says where its batches come from" "$tmp/out" \
    "tokenised from the text as each is drawn"
  same_figures "text${mode:+ $mode}: the losses, gradient norms and val losses of the shards, bit for bit" \
    "$tmp/a$i" "$tmp/b$i"
done

# By default: packed rows from the text come in order, saying so (the shards' --no-shuffle batches);
# padded rows are shuffled as the shards' are.
expect "text, by default: trains" 0 "${run0[@]}" --out "$tmp/d1" --tokenize-on-the-fly
contains "text, packed, by default: the run says its batches come in order" "$tmp/out" \
  "batches in order: packed rows read from the text cannot be shuffled"
same_figures "text, packed, by default: the shards' batches in order, bit for bit" "$tmp/a1" "$tmp/d1"
expect "shards --no-pack, by default: trains" 0 "${run0[@]}" --no-pack --out "$tmp/d2"
expect "text --no-pack, by default: trains" 0 "${run0[@]}" --no-pack --out "$tmp/d3" --tokenize-on-the-fly
same_figures "--no-pack, by default: the shuffled batches of --shuffle, from the shards" "$tmp/a3" "$tmp/d2"
same_figures "--no-pack, by default: the text's shuffled batches are the shards'" "$tmp/d2" "$tmp/d3"

# --resume: 2 steps from the text, resumed to 4 from the text; 2 from the shards, resumed from the text.
expect "text: 2 steps" 0 "${run[@]}" --steps 2 --out "$tmp/c" --tokenize-on-the-fly
expect "text: resumed to 4" 0 "${run[@]}" --out "$tmp/c" --tokenize-on-the-fly --resume
same_figures "text: 2 steps and a resume give the shards' 4 steps" "$tmp/a1" "$tmp/c"
expect "shards: 2 steps" 0 "${run[@]}" --steps 2 --out "$tmp/e"
expect "shards' checkpoint resumed from the text" 0 "${run[@]}" --out "$tmp/e" --tokenize-on-the-fly --resume
same_figures "a shards' checkpoint resumed from the text gives the shards' 4 steps" "$tmp/a1" "$tmp/e"

# Errors. Shuffled packed rows: a usage error that says why.
expect "--shuffle with packed rows is a usage error" 2 "${run[@]}" --shuffle --out "$tmp/x1" --tokenize-on-the-fly
contains "--shuffle with packed rows says why" "$tmp/err" "cannot --shuffle packed rows"
[ -e "$tmp/x1" ] && fail "a usage error made --out" || ok "a usage error makes no --out"

# A file changed since prep, on a run that would resume: exit 1, the file and the reason, and the
# checkpoint and log in --out as they were.
cp "$tmp/c/checkpoint.safetensors" "$tmp/ckpt.before"
cp "$tmp/c/log.jsonl" "$tmp/log.before"
echo "one more line" >>"$tmp/corpus/more/d12.txt"
expect "an input file changed since prep" 1 "${run[@]}" --steps 6 --out "$tmp/c" --tokenize-on-the-fly --resume
contains "the changed file is named, with the reason" "$tmp/err" "$tmp/corpus/more/d12.txt: error: changed since \`mdlc prep\` read it"
if cmp -s "$tmp/c/checkpoint.safetensors" "$tmp/ckpt.before" && cmp -s "$tmp/c/log.jsonl" "$tmp/log.before"; then
  ok "the refused run leaves --out's checkpoint and log as they were"
else
  fail "the refused run changed --out"
fi
expect "a new run on the changed input" 1 "${run[@]}" --out "$tmp/x2" --tokenize-on-the-fly
[ -e "$tmp/x2" ] && fail "the refused run made --out" || ok "the refused run makes no --out"
expect "the shards still train without the text" 0 "${run[@]}" --out "$tmp/x3"

# The input moved, and a data folder without source.txt (made before prep wrote one).
$m prep "$tmp/corpus" -o "$tmp/data2" --vocab 300 --val-fraction 0.2 >/dev/null 2>&1 || fail "prep again"
mv "$tmp/corpus" "$tmp/corpus-moved"
run2=(models/gpt2-tiny.mdl --backend cpu --steps 4 -D B=2 -D T=32 -D V=300 --data "$tmp/data2")
expect "the input moved since prep" 1 "${run2[@]}" --out "$tmp/x4" --tokenize-on-the-fly
contains "the moved input is named, with the reason" "$tmp/err" "$tmp/corpus: error: cannot open: No such file or directory: the input \`mdlc prep\` read"
mv "$tmp/corpus-moved" "$tmp/corpus"
expect "the input back in place trains" 0 "${run2[@]}" --out "$tmp/x5" --tokenize-on-the-fly
if [ "$(id -u)" -ne 0 ]; then
  chmod 000 "$tmp/corpus/d3.txt"
  expect "an input file unreadable" 1 "${run2[@]}" --out "$tmp/x6" --tokenize-on-the-fly
  contains "the unreadable file is named" "$tmp/err" "$tmp/corpus/d3.txt: error: cannot read: Permission denied"
  chmod 644 "$tmp/corpus/d3.txt"
else
  echo "[skip] onthefly: an unreadable input file (root reads every file)"
fi
rm "$tmp/data2/source.txt"
expect "a data folder without source.txt" 1 "${run2[@]}" --out "$tmp/x7" --tokenize-on-the-fly
contains "the missing source.txt is named, with the reason" "$tmp/err" \
  "$tmp/data2/source.txt: error: not found: the shards in $tmp/data2 do not say what text they came from"
