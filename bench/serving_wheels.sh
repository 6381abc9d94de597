#!/usr/bin/env bash
# Wheels of transformers' serving packages (fastapi, uvicorn, openai, pydantic and what they
# need) and nvidia-ml-py (bench_serve.py's GPU utilization), for Python 3.12 on x86-64, into DIR
# (default .swhl, ignored by git): the GPU image has none of them, and zos serve, bench_serve.py
# and serve_ready.py need them (~10 MB).
#   bash bench/serving_wheels.sh [DIR]
# then, on the GPU machine (carry DIR):
#   python3 -m pip install --no-index --find-links DIR fastapi uvicorn openai pydantic nvidia-ml-py
set -euo pipefail
DIR=${1:-.swhl}
python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR" fastapi uvicorn openai pydantic nvidia-ml-py
