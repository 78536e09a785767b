#!/usr/bin/env bash
# `mdlc prep`: a folder (text, JSONL, a binary file, a symlink) and a JSONL file become shards and
# a tokenizer file. A Python reader (struct + json only) checks the llm.c headers and decodes the
# shards with tokenizer.bin, comparing every document and its split with what it finds in the
# input on its own. Then the errors: missing or empty input, bad JSONL, bad vocab, an existing DIR.
# Until mdlc has the verb, a small driver built from runtime/ stands in for it.
set -u
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if bin/mdlc --help 2>/dev/null | grep -q '^ *prep '; then
  prep() { bin/mdlc prep "$@"; }
else
  cat >"$tmp/driver.c" <<'EOF'
#include "data.h"
#include <getopt.h>
#include <stdlib.h>
int main(int argc, char **argv) {
  PrepOptions o;
  prep_defaults(&o);
  static const struct option lo[] = {{"vocab", 1, 0, 'v'},        {"doc-sep", 1, 0, 's'}, {"val-fraction", 1, 0, 'f'},
                                     {"text-field", 1, 0, 't'},   {"shard-tokens", 1, 0, 'n'},
                                     {"force", 0, 0, 'F'},        {0, 0, 0, 0}};
  for (int c; (c = getopt_long(argc, argv, "o:", lo, NULL)) != -1;)
    switch (c) {
    case 'o': o.out_dir = optarg; break;
    case 'v': o.vocab = atoi(optarg); break;
    case 's': o.doc_sep = optarg; break;
    case 'f': o.val_fraction = atof(optarg); break;
    case 't': o.text_field = optarg; break;
    case 'n': o.shard_tokens = atoll(optarg); break;
    case 'F': o.force = true; break;
    default: return 2;
    }
  if (optind + 1 != argc) return 2;
  o.input = argv[optind];
  return prep_run(&o);
}
EOF
  if ! ${CC:-cc} -std=c11 -D_GNU_SOURCE -O1 $(for d in compiler compiler/*/ runtime runtime/*/; do printf -- "-I%s " "${d%/}"; done) -o "$tmp/prep" "$tmp/driver.c" runtime/data/tokenizer.c \
      runtime/data/shard.c runtime/data/loader.c runtime/data/permute.c runtime/data/corpus.c runtime/data/prep.c compiler/base/diag.c -lm -lpthread 2>"$tmp/cc.err"; then
    echo "[fail] prep: cannot build the stand-in driver: $(head -c 300 "$tmp/cc.err")"
    exit 1
  fi
  prep() { "$tmp/prep" "$@"; }
fi

expect() { # expect NAME STATUS ARGS...: prep ARGS exits with STATUS
  local name=$1 want=$2; shift 2
  prep "$@" >"$tmp/stdout" 2>"$tmp/stderr"; local rc=$?
  if [ "$rc" -eq "$want" ]; then echo "[ok] prep: $name"; else
    echo "[fail] prep: $name: status $rc, wanted $want: $(head -c 300 "$tmp/stderr")"; fi
}
contains() { # contains NAME FILE TEXT
  if grep -qF -- "$3" "$2"; then echo "[ok] prep: $1"; else
    echo "[fail] prep: $1: '$3' not in: $(head -c 300 "$2")"; fi
}
absent() { # absent NAME PATH: nothing was written
  if [ ! -e "$2" ]; then echo "[ok] prep: $1"; else echo "[fail] prep: $1: $2 exists"; fi
}

# verify DIR INPUT SEP FIELD FRACTION VOCAB: the shards hold exactly INPUT's documents.
cat >"$tmp/verify.py" <<'EOF'
import glob, json, os, struct, sys
out, inp, sep, field, frac, vocab = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6])

def fail(why):
    print(why)
    sys.exit(1)

raw = open(os.path.join(out, "tokenizer.bin"), "rb").read()
if raw[:8] != b"MDLTOK1\0":
    fail("tokenizer.bin: bad magic")
v, nm = struct.unpack("<II", raw[8:16])
if v != 256 + nm or len(raw) != 16 + 8 * nm or v > vocab:
    fail(f"tokenizer.bin: vocab {v}, {nm} merges, {len(raw)} bytes")
pieces = [bytes([i]) for i in range(256)]
pieces[0] = b""
for r in range(nm):
    a, b = struct.unpack("<II", raw[16 + 8 * r:24 + 8 * r])
    pieces.append(pieces[a] + pieces[b])

got = []
for split in ("train", "val"):
    toks = []
    for p in sorted(glob.glob(os.path.join(out, split + "_*.bin"))):
        data = open(p, "rb").read()
        h = struct.unpack("<256i", data[:1024])
        if h[0] != 20240520 or h[1] != 1 or h[2] != (len(data) - 1024) // 2 or len(data) % 2:
            fail(f"{p}: header {h[:3]}, {len(data)} bytes")
        toks += struct.unpack(f"<{h[2]}H", data[1024:])
    if not toks or toks[0] != 0:
        fail(f"{split}: does not start with EOS")
    if max(toks) >= v:
        fail(f"{split}: token {max(toks)} >= vocab {v}")
    docs = []
    for t in toks:
        if t == 0:
            docs.append([])
        else:
            docs[-1].append(pieces[t])
    got += [(split, b"".join(d)) for d in docs]

def split_sep(data):
    if not sep:
        return [data]
    docs, start, pos = [], 0, 0
    for line in data.split(b"\n"):
        end = pos + len(line) + 1
        if line.rstrip(b"\r") == sep.encode():
            docs.append(data[start:pos])
            start = min(end, len(data))
        pos = end
    docs.append(data[start:])
    return docs

files = []
if os.path.isdir(inp):
    for root, dirs, names in os.walk(inp, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [os.path.join(root, n) for n in names if not n.startswith(".")]
    files.sort()
else:
    files = [inp]
want, seen = [], set()
for f in files:
    st = os.stat(f)
    if (st.st_dev, st.st_ino) in seen:
        continue
    seen.add((st.st_dev, st.st_ino))
    data = open(f, "rb").read()
    if b"\0" in data:
        continue
    if f.endswith(".jsonl"):
        want += [json.loads(l)[field].encode() for l in data.decode().split("\n") if l.strip()]
    else:
        want += split_sep(data)
want = [d for d in want if d]
# corpus_part's split by size (runtime/data/corpus.c), in the same double arithmetic
total, before, held, expected = sum(len(d) for d in want), 0, 0, []
for i, d in enumerate(want):
    n = len(d)
    val = (held == 0 and (i == len(want) - 1 or 2 * held + n < 2 * frac * total)) or \
        2 * held + n < 2 * frac * (before + n)
    expected.append(("val" if val else "train", d))
    held += n if val else 0
    before += n
order = lambda docs: [d for d in docs if d[0] == "train"] + [d for d in docs if d[0] == "val"]
if got != order(expected):
    fail(f"documents differ: {len(got)} decoded, {len(expected)} expected")
print(f"{len(got)} documents, vocab {v}")
EOF
verify() { # verify NAME DIR INPUT SEP FIELD FRACTION VOCAB
  local name=$1; shift
  if python3 "$tmp/verify.py" "$@" >"$tmp/py" 2>&1; then echo "[ok] prep: $name"; else
    echo "[fail] prep: $name: $(tail -c 300 "$tmp/py")"; fi
}

# A folder: text files split at "%", JSONL, a binary file, a symlink to a file seen, a dot file.
mkdir -p "$tmp/corpus/poems" "$tmp/corpus/.git"
printf 'Roses are red.\n%%\nViolets are blue;\nsugar is sweet.\n%%\n' >"$tmp/corpus/poems/a.txt"
printf 'Unicode: caf\xc3\xa9, \xe6\x97\xa5\xe6\x9c\xac, \xf0\x9f\x8e\x89\n\ttabs\r\n%%\nsecond\n' >"$tmp/corpus/poems/b.txt"
for i in $(seq 1 30); do printf 'fortune number %d says: the %d-th time is the charm.\n%%\n' "$i" "$i"; done >"$tmp/corpus/many"
printf '{"text": "json one \\u00e9"}\n{"text": "json two", "n": [1, 2.5e3, {"a": null}]}\n' >"$tmp/corpus/docs.jsonl"
printf '\0\0\0\2index' >"$tmp/corpus/many.dat"
printf 'ignored\n' >"$tmp/corpus/.git/HEAD"
ln -s many "$tmp/corpus/many.u8"
expect "a folder" 0 "$tmp/corpus" -o "$tmp/out" --vocab 300 --doc-sep % --val-fraction 0.1
for f in train_000000.bin val_000000.bin tokenizer.bin; do
  if [ -s "$tmp/out/$f" ]; then echo "[ok] prep: writes $f"; else echo "[fail] prep: writes $f: missing"; fi
done
if [ -z "$(find "$tmp/out" -name '.*tmp*')" ]; then echo "[ok] prep: no temporary files left"; else
  echo "[fail] prep: temporary files left: $(ls -a "$tmp/out")"; fi
contains "a binary file is skipped with a note" "$tmp/stderr" "many.dat: note: skipped: not a text file"
# source.txt: what the shards were made from, for `mdlc run --tokenize-on-the-fly`.
abs=$(realpath "$tmp/corpus")
contains "source.txt names the input, absolute" "$tmp/out/source.txt" "input $abs"
contains "source.txt holds --doc-sep" "$tmp/out/source.txt" "doc-sep %"
contains "source.txt holds --val-fraction" "$tmp/out/source.txt" "val-fraction 0.1"
contains "source.txt holds the split" "$tmp/out/source.txt" "train 32 documents"
contains "source.txt lists a text file with its size" "$tmp/out/source.txt" \
  "file text $(stat -c %s "$tmp/corpus/docs.jsonl") $(stat -c %Y "$tmp/corpus/docs.jsonl")."
contains "source.txt marks a binary file" "$tmp/out/source.txt" "file binary 9 "
if grep -q "many.u8" "$tmp/out/source.txt"; then echo "[fail] prep: source.txt lists a file seen before"; else
  echo "[ok] prep: source.txt leaves out a file seen before"; fi
contains "the summary counts documents" "$tmp/stdout" "prep: 36 documents (32 train, 4 val)"
contains "the summary names bytes per token and vocab" "$tmp/stdout" "bytes per token (EOS not counted), vocab"
verify "the folder's documents decode back, in order, split by size" "$tmp/out" "$tmp/corpus" % text 0.1 300

# The split is by size, documents whole: three files of 2.5, 5 and 20 kB with --val-fraction 0.1 give
# val about a tenth of the tokens (it was the third file, 73%, by document count). Two equal files
# cannot split near a tenth: a warning says so, with the share.
mkdir -p "$tmp/three" "$tmp/two"
for f in a:2500 b:5000 c:20000; do head -c "${f#*:}" /usr/share/common-licenses/GPL-3 >"$tmp/three/${f%:*}.txt"; done
expect "three unequal files" 0 "$tmp/three" -o "$tmp/out3" --val-fraction 0.1
share=$(sed -n 's/^prep: [0-9]* tokens (train \([0-9]*\), val \([0-9]*\)).*/\1 \2/p' "$tmp/stdout" |
  awk '{ printf "%.3f", $2 / ($1 + $2) }')
awk -v s="$share" 'BEGIN { exit !(s >= 0.07 && s <= 0.13) }' &&
  echo "[ok] prep: three unequal files: val holds $share of the tokens for --val-fraction 0.1" ||
  echo "[fail] prep: three unequal files: val holds '$share' of the tokens for --val-fraction 0.1: $(cat "$tmp/stdout")"
if grep -q warning "$tmp/stderr"; then echo "[fail] prep: a split near the fraction warns: $(cat "$tmp/stderr")"; else
  echo "[ok] prep: a split near the fraction gives no warning"; fi
verify "three unequal files decode back, split by size" "$tmp/out3" "$tmp/three" "" text 0.1 256
head -c 1000 /usr/share/common-licenses/GPL-3 >"$tmp/two/a.txt"
tail -c 1000 /usr/share/common-licenses/GPL-3 >"$tmp/two/b.txt"
expect "two equal files with --val-fraction 0.1" 0 "$tmp/two" -o "$tmp/out2" --val-fraction 0.1
contains "an odd split warns, with the share" "$tmp/stderr" \
  "$tmp/two: warning: the val split holds 50.0% of the tokens, where --val-fraction asks 10.0%"

# A JSONL file with another field name, byte-level.
printf '{"body": "first \\"quoted\\" line\\n", "text": 5}\n{"body": "second"}\n{"body": "third \\ud83d\\ude00"}\n' >"$tmp/d.jsonl"
expect "a JSONL file (--text-field)" 0 "$tmp/d.jsonl" -o "$tmp/outj" --text-field body --val-fraction 0.5
verify "the JSONL documents decode back" "$tmp/outj" "$tmp/d.jsonl" "" body 0.5 256

# Shards of at most --shard-tokens tokens; --force replaces them, removing the extra ones.
expect "small shards" 0 "$tmp/corpus" -o "$tmp/outs" --doc-sep % --shard-tokens 300
n=$(ls "$tmp/outs"/train_*.bin | wc -l)
if [ "$n" -gt 3 ]; then echo "[ok] prep: --shard-tokens cuts shards ($n)"; else echo "[fail] prep: --shard-tokens: $n shards"; fi
verify "documents survive the shard cuts" "$tmp/outs" "$tmp/corpus" % text 0.05 256
expect "an existing DIR is an error" 1 "$tmp/corpus" -o "$tmp/outs" --doc-sep %
contains "the existing DIR error" "$tmp/stderr" "$tmp/outs: error: already holds shards; use --force to overwrite"
expect "--force overwrites" 0 "$tmp/corpus" -o "$tmp/outs" --doc-sep % --force
n=$(ls "$tmp/outs"/train_*.bin | wc -l)
if [ "$n" -eq 1 ]; then echo "[ok] prep: --force removes the old extra shards"; else echo "[fail] prep: --force left $n shards"; fi
verify "the rewritten DIR holds the corpus" "$tmp/outs" "$tmp/corpus" % text 0.05 256

# Errors: one line naming the path, exit 1, nothing written.
expect "missing input" 1 "$tmp/nope" -o "$tmp/e1"
contains "missing input is named" "$tmp/stderr" "$tmp/nope: error: cannot open"
absent "missing input writes nothing" "$tmp/e1"
: >"$tmp/empty.txt"
expect "empty input" 1 "$tmp/empty.txt" -o "$tmp/e2"
contains "empty corpus is named" "$tmp/stderr" "$tmp/empty.txt: error: empty corpus"
absent "empty input writes nothing" "$tmp/e2"
printf '{"text": "fine"}\n{"text": "broken\n' >"$tmp/bad.jsonl"
expect "a bad JSONL line" 1 "$tmp/bad.jsonl" -o "$tmp/e3"
contains "a bad JSONL line names file:line" "$tmp/stderr" "$tmp/bad.jsonl:2: error: an unterminated string"
absent "a bad JSONL line writes nothing" "$tmp/e3"
printf '{"text": "fine"}\n{"title": "no text"}\n' >"$tmp/nofield.jsonl"
expect "a JSONL line without the field" 1 "$tmp/nofield.jsonl" -o "$tmp/e4"
contains "the missing field names file:line" "$tmp/stderr" "$tmp/nofield.jsonl:2: error: no text field"
expect "vocab out of range is a usage error" 2 "$tmp/corpus" -o "$tmp/e5" --vocab 70000
contains "vocab out of range is named" "$tmp/stderr" "--vocab wants a size from 256 to 65536, got '70000'"
absent "vocab out of range writes nothing" "$tmp/e5"
expect "a binary file as input" 1 "$tmp/corpus/many.dat" -o "$tmp/e6"
contains "a binary input is not text" "$tmp/stderr" "many.dat: error: not a text file"
if [ "$(wc -l <"$tmp/stderr")" -eq 1 ]; then echo "[ok] prep: an error is one line"; else
  echo "[fail] prep: an error is one line: $(cat "$tmp/stderr")"; fi

# fortune's files: ~2.5 MB of text, *.dat indexes and *.u8 symlinks; a 4096 vocab trains fast.
f=/usr/share/games/fortunes
if [ -d "$f" ]; then
  start=$(date +%s%N)
  expect "fortunes with a 4096 vocab" 0 "$f" -o "$tmp/fort" --vocab 4096 --doc-sep %
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  if [ "$ms" -lt 20000 ]; then echo "[ok] prep: fortunes in $ms ms"; else echo "[fail] prep: fortunes took $ms ms"; fi
  contains "fortunes: vocab 4096" "$tmp/stdout" "vocab 4096"
  verify "fortunes decode back document for document" "$tmp/fort" "$f" % text 0.05 4096
else
  echo "[skip] prep: fortunes: $f is not installed"
fi
