#!/usr/bin/env bash
# Wheels of transformers 5.25.0 and what it needs beside the GPU machine's packages (which
# have transformers 5.17.0, huggingface-hub 1.x and no `kernels`), for Python 3.12 on x86-64,
# into DIR (default .whl, ignored by git): about 26 MB, one device call's carry.
#   bash bench/tf525_wheels.sh [DIR]
# then, on the GPU machine:  TF525_WHEELS=$PWD/.whl bash bench/gpu_check.sh   (carry .whl)
set -euo pipefail
DIR=${1:-.whl}
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" \
  "transformers==5.25.0" "huggingface-hub==2.4.0" "kernels==0.19.1" "tomlkit>=0.13.3" \
  "httpx2==2.17.0" "httpcore2==2.17.0" "truststore>=0.10" "idna>=3.18" "anyio>=4.10" "h11" \
  "hf-xet>=1.6,<2" "click>=8.4.2,<9" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" \
  "regex>=2025.10.22" "typer" "shellingham"
