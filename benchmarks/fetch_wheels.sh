#!/usr/bin/env bash
# Download the wheels a GPU machine without network access lacks into benchmarks/wheels/ (ignored by git; carried
# with the device call; run_gpu.sh installs each one the image lacks, with --no-deps). The GPU image (Python 3.12,
# torch 2.11+cu130) has torch, triton, numpy, safetensors, huggingface-hub, transformers, pillow and pytest-timeout.
# - diffusers: its one requirement missing there, importlib_metadata, is imported only on Python < 3.8.
# - pytest-timeout: in case an image lacks it (run_gpu.sh passes --timeout only when it imports).
# - xformers 0.0.35, the newest on PyPI: one wheel for Python >= 3.9 and torch >= 2.10, but its C++ kernels are built
#   against CUDA 12 (libcudart.so.12), which a cu130 torch does not ship. There they fail to load and xformers' flash
#   op runs PyTorch's own flash-attention; the benchmark's xformers rows say so. CUDA 13 builds are not on PyPI.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p wheels
GPU_PYTHON=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)
pip download --no-deps --only-binary=:all: "${GPU_PYTHON[@]}" --dest wheels \
  "diffusers==0.42.1" "pytest-timeout==2.4.0" "xformers==0.0.35"
ls -la wheels
