#!/usr/bin/env bash
# Rewrites generated/<model>/ from models/<model>.mdl: what `mdlc build` emits, committed so that a
# person can read what fusion did and a test can tell when it changes. With --checkpoint none: the
# default, auto, recomputes where the memory there is falls short, which depends on the machine.
set -eu
cd "$(dirname "$0")/.."
for m in models/*.mdl; do
  name=$(basename "$m" .mdl)
  rm -rf "generated/$name"
  mkdir -p "generated/$name"
  bin/mdlc build "$m" --checkpoint none -o "generated/$name"
done
