#!/usr/bin/env bash
# Download the pure-Python wheels a GPU machine without network access lacks into benchmarks/wheels/
# (ignored by git; carried with the device call). The GPU image has torch, triton, numpy, safetensors,
# huggingface-hub, transformers and pillow; diffusers is what it lacks. run_gpu.sh installs it with --no-deps: its
# one requirement missing there, importlib_metadata, is imported only on Python < 3.8.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
pip download --no-deps --only-binary=:all: --dest wheels "diffusers==0.42.1" "pytest-timeout"
ls -la wheels
