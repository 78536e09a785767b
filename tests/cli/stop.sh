#!/usr/bin/env bash
# A run stopped from outside, and a run short of memory: SIGINT to mdlc alone while the C compiler
# runs stops the compiler and the run at once, saying so; SIGTERM while training runs the stop
# handler on an alternate signal stack (a GEMM kernel may have pointed the stack into the heap), and
# at a random moment of the first steps and validations always ends the run as SIGTERM (status 143,
# or 0 when it finished first), never in a crash or a damaged heap; a shard that cannot be mapped a
# second time for the unigram entropy (a memory limit) leaves a warning, not an error, on a run that
# succeeds.
set -u
cd "$(dirname "$0")/../.."
m=$PWD/bin/mdlc
tmp=$(mktemp -d)
pid=
kids=
trap '[ -n "$pid" ] && kill -9 $pid 2>/dev/null; for k in $kids; do kill -9 $k 2>/dev/null; done; rm -rf "$tmp"' EXIT
ok() { echo "[ok] stop: $1"; }
fail() { echo "[fail] stop: $1"; }
check() { if eval "$2"; then ok "$1"; else fail "$1: $(tail -c 400 "$tmp/err" 2>/dev/null)"; fi; }
export MDL_CACHE=$tmp/cache

mkdir -p "$tmp/corpus"
for i in $(seq 1 8); do head -c $((3000 * i)) /usr/share/common-licenses/GPL-3 | tail -c 3000 >"$tmp/corpus/d$i.txt"; done
$m prep "$tmp/corpus" -o "$tmp/data" >/dev/null 2>&1 || fail "prep"
small=(-D B=2 -D T=16 --data "$tmp/data" --backend cpu)

# 1. SIGINT to mdlc alone (not its process group, as a terminal's Ctrl-C would) while a stand-in
# compiler waits: the compiler is stopped, the run ends at once as SIGINT, saying so, and leaves
# nothing of the compile in the cache. (It used to wait for the compiler, then end silently.)
mkdir -p "$tmp/fakecc" "$tmp/cc-cache"
cat >"$tmp/fakecc/cc" <<EOF
#!/bin/sh
echo \$\$ >"$tmp/fakecc.pid"
while [ \$# -gt 0 ]; do [ "\$1" = -o ] && out=\$2; shift; done
echo partial >"\$out"
exec sleep 3600
EOF
chmod +x "$tmp/fakecc/cc"
with_sigint='import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])'
PATH="$tmp/fakecc:$PATH" MDL_CACHE="$tmp/cc-cache" python3 -c "$with_sigint" $m run models/gpt2-tiny.mdl \
  "${small[@]}" --steps 1 --out "$tmp/ccint" >/dev/null 2>"$tmp/err" &
pid=$!
while [ ! -s "$tmp/fakecc.pid" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
kids=$(cat "$tmp/fakecc.pid" 2>/dev/null)
[ -n "$kids" ] || fail "the stand-in compiler never ran"
kill -INT $pid
for _ in $(seq 100); do kill -0 $pid 2>/dev/null || break; sleep 0.1; done
if kill -0 $pid 2>/dev/null; then
  fail "SIGINT during the compile: the run still waits for the compiler 10 s later"
  kill -9 $pid
fi
wait $pid
rc=$?
pid=
check "SIGINT to mdlc during the compile ends the run at once as SIGINT (status $rc), saying so" \
  "[ $rc -eq 130 ] && grep -q 'mdlc: interrupted (SIGINT) while the C compiler ran' '$tmp/err'"
check "... stops the compiler" "! kill -0 $kids 2>/dev/null"
check "... and leaves no temporary module in the cache" "! ls '$tmp/cc-cache' | grep -q '\.tmp'"

# 2. The unigram entropy's own mapping of a train shard fails (as under a memory limit: the loader
# has the shard mapped already): a warning, and the run succeeds without "error:". A preloaded mmap
# fails from the third mapping of a train shard on (the input check's, the loader's, then this one).
cat >"$tmp/nomap.c" <<'EOF'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
void *mmap(void *a, size_t n, int prot, int flags, int fd, off_t off) {
  static int shards;
  char link[64], path[4096] = "";
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t k = fd >= 0 ? readlink(link, path, sizeof path - 1) : -1;
  if (k > 0 && (path[k] = 0, strstr(path, "/train_")) && ++shards >= 3) {
    errno = ENOMEM;
    return MAP_FAILED;
  }
  void *(*real)(void *, size_t, int, int, int, off_t) = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
  return real(a, n, prot, flags, fd, off);
}
EOF
if ${CC:-cc} -shared -fPIC -o "$tmp/nomap.so" "$tmp/nomap.c" -ldl 2>"$tmp/err"; then
  $m run models/gpt2-tiny.mdl "${small[@]}" --steps 1 --out "$tmp/warm" >/dev/null 2>&1 # (the module compiled)
  LD_PRELOAD="$tmp/nomap.so" $m run models/gpt2-tiny.mdl "${small[@]}" --steps 2 --out "$tmp/nomap" \
    >"$tmp/out" 2>"$tmp/err"
  rc=$?
  check "a shard the unigram entropy cannot map: the run succeeds, with a warning and no error" \
    "[ $rc -eq 0 ] && grep -q 'warning: .*train_.*cannot map: Cannot allocate memory; the unigram entropy is left out' \
     '$tmp/err' && ! grep -q 'error:' '$tmp/err' && grep -q '^step     2/2' '$tmp/out'"
else
  echo "[skip] stop: no C compiler for the preloaded mmap"
fi

# 3. SIGTERM while training. oneDNN's GEMM kernels point the stack into the heap while they run, so
# the stop handler must run on an alternate signal stack, or its frame lands in the heap (it did: glibc
# aborted 3 runs in 230, "corrupted size vs. prev_size"; test_gemm shows the damage itself). A
# preloaded sigaction hands the run a handler that says so whenever the main thread runs it on the
# stack it interrupted: SIGTERM after the first step and after the second step's validation ends the
# run as SIGTERM (143), with its checkpoint, and the handler on its own stack.
if ${CC:-cc} -shared -fPIC -o "$tmp/onstack.so" -x c - -ldl 2>"$tmp/err" <<'EOF'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
static void (*handler)(int);
static void checked(int sig) {
  stack_t ss;
  if (syscall(SYS_gettid) == getpid() && (sigaltstack(NULL, &ss) != 0 || !(ss.ss_flags & SS_ONSTACK))) {
    static const char msg[] = "onstack: the stop handler ran on the stack it interrupted\n";
    (void)!write(2, msg, sizeof msg - 1);
  }
  handler(sig);
}
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  int (*real)(int, const struct sigaction *, struct sigaction *) =
      (int (*)(int, const struct sigaction *, struct sigaction *))dlsym(RTLD_NEXT, "sigaction");
  if (sig != SIGTERM || !act || (act->sa_flags & SA_SIGINFO) || act->sa_handler == SIG_DFL ||
      act->sa_handler == SIG_IGN)
    return real(sig, act, old);
  struct sigaction mine = *act;
  handler = act->sa_handler;
  mine.sa_handler = checked;
  return real(sig, &mine, old);
}
EOF
then
  $m run models/gpt2-tiny.mdl "${small[@]}" --steps 1 --out "$tmp/warm3" >/dev/null 2>&1 # (compiled once)
  for at in 'step     1/8 | loss' 'step     2/8 | val loss'; do
    rm -rf "$tmp/s"
    LD_PRELOAD="$tmp/onstack.so" $m run models/gpt2-tiny.mdl "${small[@]}" --steps 8 --val-every 1 --ckpt-every 1 \
      --out "$tmp/s" >"$tmp/s.out" 2>"$tmp/err" &
    pid=$!
    while ! grep -qF "$at" "$tmp/s.out" 2>/dev/null && kill -0 $pid 2>/dev/null; do sleep 0.02; done
    kill -TERM $pid 2>/dev/null
    wait $pid
    rc=$?
    pid=
    check "SIGTERM after '$at': the run ends as SIGTERM (status $rc) with its checkpoint, the stop handler on an \
alternate signal stack" "[ $rc -eq 143 ] && grep -q 'terminated (SIGTERM) at step' '$tmp/s.out' && \
      [ -s '$tmp/s/checkpoint.safetensors' ] && ! grep -q onstack: '$tmp/err'"
  done
else
  echo "[skip] stop: no C compiler for the preloaded sigaction"
fi

# 4. SIGTERM at a random moment of the first steps, validations and checkpoints (each step validated
# and checkpointed): every run ends as SIGTERM with status 143, or 0 when its 8 steps were done first,
# with no crash, no heap damage glibc detects (status 134) and, on the sanitized build of
# tests/cli/sanitize.sh where there is one (build/asan), no report. As many runs as 10 s allow, at
# least 5, at most 100.
san=$PWD/build/asan/bin/mdlc
[ -x "$san" ] && [ "$san" -nt bin/mdlc ] || san=
bin=${san:-$m}
export ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1
$bin run models/gpt2-tiny.mdl "${small[@]}" --steps 1 --out "$tmp/warm2" >/dev/null 2>&1 # (compiled once)
report='Sanitizer|runtime error:|corrupted|double free|free\(\)|malloc\(\)'
runs=0 bad=0 first=
start=$SECONDS
while [ $runs -lt 100 ] && { [ $runs -lt 5 ] || [ $((SECONDS - start)) -lt 10 ]; }; do
  runs=$((runs + 1))
  rm -rf "$tmp/t"
  $bin run models/gpt2-tiny.mdl "${small[@]}" --steps 8 --val-every 1 --ckpt-every 1 --out "$tmp/t" \
    >"$tmp/t.out" 2>&1 &
  pid=$!
  sleep "$(awk -v r=$RANDOM 'BEGIN {printf "%.3f", 0.05 + 1.2 * r / 32768}')"
  kill -TERM $pid 2>/dev/null
  wait $pid
  rc=$?
  pid=
  if { [ $rc -ne 143 ] && [ $rc -ne 0 ]; } || grep -qE "$report" "$tmp/t.out"; then
    bad=$((bad + 1))
    [ -n "$first" ] || first="status $rc: $(grep -m1 -A6 -E "$report" "$tmp/t.out" | tr '\n' '|' | head -c 900)"
  fi
done
if [ $bad -eq 0 ]; then
  ok "SIGTERM at a random moment of $runs runs${san:+ of the sanitized build}: each ended as SIGTERM or finished"
else
  fail "SIGTERM at a random moment: $bad of $runs runs ended otherwise; the first: $first"
fi
