#!/usr/bin/env bash
# Wheels the device runs need beyond ../shared/devkit/build.sh's kit, added to .devkit/extra (which
# scripts/device_suite.sh's kit() installs on the GPU machine): httptools, uvicorn's C HTTP parser
# (without it `tandem serve` parses HTTP in pure Python, h11); liger-kernel, the normal-mode trainer's
# norm / SwiGLU / rope kernels (pure Python + Triton). Run after build.sh, on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .devkit/extra
pip download httptools --python-version 3.12 --only-binary=:all: --no-deps -d .devkit/extra -q
pip download liger-kernel --no-deps -d .devkit/extra -q
ls .devkit/extra | grep -e httptools -e liger
