#!/usr/bin/env bash
# Installs what building and testing mdl needs, from Debian's packages, when it is missing: oneDNN is the
# CPU back end's GEMM library (its header at build time), OpenBLAS its fallback (and the static library
# gpu-check's bundle links), Open MPI's mpirun and libmpi data-parallel training (loaded at run time:
# mdl builds and trains alone without it).
set -eu
pkgs="make gcc flex bison libdnnl-dev libopenblas-dev python3-torch python3-numpy fortunes openmpi-bin"
missing=""
for p in $pkgs; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
echo "installing:$missing"
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null
