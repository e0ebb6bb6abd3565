#!/usr/bin/env bash
# Wheels the device runs need beyond ../shared/devkit/build.sh's kit, added to .devkit/extra (which
# scripts/device_suite.sh's kit() installs on the GPU machine): httptools, uvicorn's C HTTP parser
# (without it `tandem serve` parses HTTP in pure Python, h11); liger-kernel, the normal-mode trainer's
# norm / SwiGLU / rope kernels (pure Python + Triton); transformers 5.21 as an xz tarball (the
# machine's 5.17 reads a config by importing torch._dynamo and DTensor: ~4.5 s of a fresh
# `tandem serve`'s start; 5.21 does not, and a wheel would not fit the 64 MiB carry). Run after
# build.sh, on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devkit/extra
pip download httptools --python-version 3.12 --only-binary=:all: --no-deps -d .devkit/extra -q
pip download liger-kernel --no-deps -d .devkit/extra -q
TF=5.21.0; tmp=$(mktemp -d)
pip download transformers==$TF --no-deps -d "$tmp" -q && (cd "$tmp" && python3 -m zipfile -e transformers-$TF-*.whl pkg \
  && tar -C pkg -cf - transformers transformers-$TF.dist-info | xz -9 -T0 > "$OLDPWD/.devkit/transformers.tar.xz")
rm -rf "$tmp"
ls .devkit/extra | grep -e httptools -e liger; ls -la .devkit/transformers.tar.xz
