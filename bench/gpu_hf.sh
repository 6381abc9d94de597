#!/usr/bin/env bash
# The transformers benchmark on one GPU machine, one call of about 5 minutes, from the
# repository root:   bash bench/gpu_hf.sh
# Writes hf_<gpu>_<date>.json and hf.log under $OUT (default ./gpu_hf_out).
set -u
OUT=${OUT:-$PWD/gpu_hf_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }
timeout "${HF_TIMEOUT:-480}" python3 bench/bench_hf.py --requests "${HF_REQUESTS:-16,64,256}" \
  --repeats "${HF_REPEATS:-1}" --out "$OUT" > "$OUT/hf.log" 2>&1
echo "bench_hf rc=$?"; grep -E "^N=|wrote|Error|error" "$OUT/hf.log" | tail -20
