#!/usr/bin/env bash
# `mdlc lab` on gpt2-tiny, a few steps a row: the ladder's rows and the alone table are all there,
# every run trained (finite losses, within a tolerance of the baseline's), each technique's worth alone
# divides the right two runs' tokens/s (from their own logs), the leak check passes with the document
# mask and fails without it, and lab.md, lab.csv and lab.svg are written and parse. Then what the lab
# must not do: remove a rows folder it did not make, or anything in its own but the row folders; run
# every row on data that is not there; report a killed row by its last line; leave a row's run
# running when the lab is stopped.
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
lab_pid=
trap '[ -n "$lab_pid" ] && kill -0 "$lab_pid" 2>/dev/null && kill -TERM "$lab_pid"; rm -rf "$tmp"' EXIT
ok() { echo "[ok] lab: $1"; }
fail() { echo "[fail] lab: $1"; }
check() { if eval "$2"; then ok "$1"; else fail "$1: $(tail -c 800 "$tmp/out" 2>/dev/null)"; fi; }

# variable-length documents: the paragraphs of two licences
mkdir "$tmp/txt"
cp /usr/share/common-licenses/GPL-3 /usr/share/common-licenses/Apache-2.0 "$tmp/txt/"
$m prep "$tmp/txt" --doc-sep "" -o "$tmp/data" >/dev/null 2>"$tmp/out" || fail "prep: $(cat "$tmp/out")"

MDL_CACHE=$tmp/cache $m lab models/gpt2-tiny.mdl --data "$tmp/data" --steps 6 -D B=4 -D T=64 --backend cpu \
  --out "$tmp/lab" >"$tmp/out" 2>&1
rc=$?
cp "$tmp/out" "$tmp/progress"
check "the lab exits 0 with every run done" "[ $rc -eq 0 ]"
check "a progress line per row, row k of n with an ETA" \
  "grep -qE '^lab: row 1 of [0-9]+: baseline \\(everything off\\) \\(ETA \\?\\)' '$tmp/out' &&
   grep -qE '^lab: row 2 of [0-9]+: \\+ bf16 \\(ETA [0-9]+' '$tmp/out'"
for t in "bf16" "fusion" "flash attention" "fused optimizer" "checkpointing" "packing" "pre-tokenised data"; do
  check "the ladder adds $t and the alone table takes it away" \
    "grep -qE '^\\| \\+ $t \\| [0-9]+ \\([0-9]+-[0-9]+\\) \\| [0-9.]+% \\| [0-9]+ \\| [0-9]+ \\| [0-9.]+x \\| [0-9.]+x \\| [0-9.]+ \\| [0-9.]+ \\|$' '$tmp/lab/lab.md' &&
     grep -qE '^\\| $t \\| [^|]+ \\| [0-9]+ \\([0-9]+-[0-9]+\\) \\| [0-9.]+x \\| [0-9.]+ \\| [a-z]' '$tmp/lab/lab.md'"
done
check "fp8 runs apart on the CPU (emulated), outside the ladder, with what it costs and why" \
  "grep -qE '^\\| fp8 \\| [^|]+ \\| [0-9]+ \\([0-9]+-[0-9]+\\) \\(with it\\) \\| [0-9.]+x \\| [0-9.]+ \\| (costs|changes little|pays): emulated on a CPU' '$tmp/lab/lab.md' &&
   ! grep -q '^| + fp8 ' '$tmp/lab/lab.md' && grep -q '^apart,\"fp8\",ok,' '$tmp/lab/lab.csv'"
check "the leak check passes with the document mask and fails without it" \
  "grep -qE '^Document mask: the leak check passes: .* leaves the other [0-9]+ positions. logits bit-identical; without it the leak check fails: .* changes the logits of [1-9][0-9]* of the [0-9]+ positions of other documents' '$tmp/lab/lab.md'"
check "checkpointing's row: the largest batch within the budget without it, and a larger one with it" \
  "grep -qE '^Checkpointing: within [0-9]+ MB \\(.*\\), the largest batch is B=4 without it \\([0-9]+ tokens/s\\) and B=([5-9]|[1-9][0-9]+) with it' '$tmp/lab/lab.md'"
# the CSV: a header and one line per run, every loss finite and within 15% of the baseline's
python3 - "$tmp/lab/lab.csv" >"$tmp/csv" 2>&1 <<'PY'
import csv, math, sys
rows = list(csv.DictReader(open(sys.argv[1])))
ran = [r for r in rows if r["status"] == "ok"]
base = float(ran[0]["loss"])
bad = [r["row"] for r in ran if not (math.isfinite(float(r["loss"])) and abs(float(r["loss"]) - base) <= 0.15 * base)]
kinds = {r["table"] for r in rows}
print(len(rows), len(ran), base, bad, sorted(kinds))
sys.exit(0 if len(ran) >= 18 and not bad and kinds == {"ladder", "alone", "apart", "checkpoint", "no-doc-mask"} and
         all(float(r["tok_s"]) > 0 and float(r["peak_mb"]) > 0 and int(r["kernels"]) > 0 for r in ran) else 1)
PY
csv_rc=$?
check "lab.csv: every run's row, each loss finite and within 15% of the baseline's ($(cat "$tmp/csv"))" "[ $csv_rc -eq 0 ]"
# worth alone: the full system's tokens/s over the row's without the technique (a row apart: the row's
# with it over the full system's), each the median of the run's logged steps after the warm-up
python3 - "$tmp/lab" "$tmp/progress" >"$tmp/ratio" 2>&1 <<'PY'
import csv, json, re, statistics, sys
lab, progress = sys.argv[1], sys.argv[2]
folder = {}  # a row's label -> its folder, from the progress lines
for line in open(progress):
    m = re.match(r"lab: row (\d+) of \d+: (.*) \(ETA [^)]*\)$", line.rstrip("\n"))
    if m:
        folder[m.group(2)] = "%s/rows/%02d" % (lab, int(m.group(1)))
md = open(lab + "/lab.md").read()
warm = int(re.search(r"median after (\d+) warm-up", md).group(1))
def tok_s(label):
    steps = [json.loads(l) for l in open(folder[label] + "/log.jsonl")]
    return statistics.median([s["tok_s"] for s in steps if "tok_s" in s][warm:])
rows = list(csv.DictReader(open(lab + "/lab.csv")))
full = tok_s([r for r in rows if r["table"] == "ladder"][-1]["row"])
worth = dict(re.findall(r"^\| ([a-z0-9 -]+) \| [^|]+ \| [^|]+ \| ([0-9.]+)x \|", md, re.M))
bad, told = [], 0
for r in rows:
    if r["table"] not in ("alone", "apart"):
        continue
    x = (tok_s("everything on and " + r["row"]) / full if r["table"] == "apart"
         else full / tok_s("everything on but " + r["row"]))
    told += abs(x - 1 / x) > 0.01  # (a ratio the other way round would show)
    if abs(float(r["vs_baseline"]) - x) > 1e-4 * (1 + x) or abs(float(worth.get(r["row"], "nan")) - x) > 0.0051:
        bad.append("%s: %s in lab.csv, %sx in lab.md, the runs' %.4f" % (r["row"], r["vs_baseline"], worth.get(r["row"]), x))
print("%d of 8 techniques, %d telling the direction; full system %.0f tokens/s; %s" % (len(worth), told, full, bad))
sys.exit(0 if not bad and len(worth) == 8 and "the full system (%.0f tokens/s)" % full in md else 1)
PY
ratio_rc=$?
check "each technique's worth alone divides the right two runs' tokens/s ($(cat "$tmp/ratio"))" "[ $ratio_rc -eq 0 ]"
python3 -c "import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); \
  sys.exit(0 if r.tag.endswith('svg') and len([e for e in r.iter() if e.tag.endswith('rect')]) >= 14 else 1)" \
  "$tmp/lab/lab.svg" 2>"$tmp/out"
check "lab.svg parses, with a bar per technique in each table" "[ $? -eq 0 ]"
check "each row's run is kept with its command" \
  "[ -f '$tmp/lab/rows/01/log.jsonl' ] && grep -q '^\$ mdlc run models/gpt2-tiny.mdl .*--precision fp32 --no-fuse --attention plain --optimizer-per-param --checkpoint none --no-pack --tokenize-on-the-fly' '$tmp/lab/rows/01/run.txt'"

# errors: no data; a bad budget
$m lab models/gpt2-tiny.mdl >"$tmp/out" 2>&1
check "lab without --data is an error with status 1" "[ $? -eq 1 ] && grep -q 'lab needs --data DIR' '$tmp/out'"
$m lab models/gpt2-tiny.mdl --data "$tmp/data" --memory-budget lots >"$tmp/out" 2>&1
check "a budget that is not a size is a usage error (status 2)" "[ $? -eq 2 ] && grep -q -- '--memory-budget wants' '$tmp/out'"

# data that is not there: refused once, before any row and before --out is made
$m lab models/gpt2-tiny.mdl --data "$tmp/none" --steps 6 -D B=4 -D T=64 --backend cpu --out "$tmp/nolab" \
  >"$tmp/out" 2>&1
check "lab --data on a folder that is not there is refused once, with the path and why, before any row" \
  "[ $? -eq 1 ] && [ \"\$(grep -c error '$tmp/out')\" = 1 ] && grep -q '^$tmp/none: error: cannot resolve the path' '$tmp/out' &&
   ! grep -q '^lab: row' '$tmp/out' && [ ! -e '$tmp/nolab' ]"

# a rows folder the lab did not make: refused, its files kept
mkdir -p "$tmp/mine/rows/01"
echo "my notes" >"$tmp/mine/rows/01/notes.txt"
MDL_CACHE=$tmp/cache timeout 120 $m lab models/gpt2-tiny.mdl --data "$tmp/data" --steps 6 -D B=4 -D T=64 \
  --backend cpu --out "$tmp/mine" >"$tmp/out" 2>&1
check "a --out whose rows folder the lab did not make is refused, and nothing in it is touched" \
  "[ $? -eq 1 ] && grep -q '^$tmp/mine/rows: error: not made by .mdlc lab.' '$tmp/out' && ! grep -q '^lab: row' '$tmp/out' &&
   [ \"\$(cat '$tmp/mine/rows/01/notes.txt')\" = 'my notes' ] && [ \"\$(ls '$tmp/mine/rows')\" = 01 ]"

# a lab again into the first's --out, with a file of the user's among the rows and steps enough to
# stop it by hand: row 1's run killed (SIGKILL), then the lab stopped (SIGTERM) during row 2
echo "my notes" >"$tmp/lab/rows/notes.txt"
MDL_CACHE=$tmp/cache $m lab models/gpt2-tiny.mdl --data "$tmp/data" --steps 1000000 -D B=4 -D T=64 --backend cpu \
  --out "$tmp/lab" >"$tmp/out" 2>&1 &
lab_pid=$!
# the pid of row $1's run (its folder's lock holds it), once the lab has started the row and the run has
# logged a step (3 minutes at most)
step_of() {
  for _ in $(seq 900); do
    grep -q "^lab: row $1 of" "$tmp/out" && [ -s "$tmp/lab/rows/0$1/log.jsonl" ] && break
    sleep 0.2
  done
  cat "$tmp/lab/rows/0$1/lock"
}
run1=$(step_of 1)
check "a lab into an earlier lab's --out removes the earlier rows and nothing else of the folder" \
  "[ \"\$(ls '$tmp/lab/rows' | tr '\\n' ' ')\" = '01 lab-rows.txt notes.txt ' ] &&
   [ \"\$(cat '$tmp/lab/rows/notes.txt')\" = 'my notes' ] && [ -f '$tmp/lab/lab.md' ]"
kill -9 "$run1"
run2=$(step_of 2)
check "a row whose run was killed is reported killed by its signal" \
  "grep -q '^lab: row 1 failed: killed by signal 9 ' '$tmp/out'"
kill -TERM "$lab_pid"
for _ in $(seq 300); do kill -0 "$run2" 2>/dev/null || break; sleep 0.2; done
kill -0 "$lab_pid" 2>/dev/null && kill -9 "$lab_pid"
wait "$lab_pid"
lab_rc=$?
lab_pid=
kill -0 "$run2" 2>/dev/null
run2_left=$?
[ $run2_left -eq 0 ] && kill -9 "$run2" # (a run the lab left running)
check "SIGTERM to the lab stops the row's run at its step (checkpoint written), then the lab, by the signal" \
  "[ $lab_rc -eq 143 ] && [ $run2_left -ne 0 ] && [ -f '$tmp/lab/rows/02/checkpoint.safetensors' ] &&
   grep -q '^terminated (SIGTERM) at step [0-9]*: wrote' '$tmp/lab/rows/02/run.txt' &&
   grep -q '^mdlc: lab: stopped by signal 15 .* during row 2 of ' '$tmp/out' && ! grep -q '^lab: row 3 ' '$tmp/out'"
