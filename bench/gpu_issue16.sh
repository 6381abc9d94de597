#!/usr/bin/env bash
# Issue 16 on one GPU machine, one call of about 8 minutes, from the repository root:
#   bash bench/gpu_issue16.sh
# Writes every log and JSON under $OUT (default ./gpu_issue16_out):
#   build.log        pip install of the extension
#   probe.log        which pointer form Triton's launcher takes for the mapped ring
#   tests.log        the staging/prep/backend tests on CUDA, the stalled-stream tests included
#   suite.log        the rest of the test suite on CUDA (test_distributed.py left out; SUITE=0 skips it)
#   memcheck.log     compute-sanitizer --tool memcheck on the prep tests (short)
#   racecheck.log    compute-sanitizer --tool racecheck on the prep tests (short)
#   prep_*.json      bench/bench_prep.py (host us per step at N = 1..1024, record bytes)
#   host_breakdown_*.json, breakdown.log   bench/host_breakdown.py
# Each part has its own time limit; a part that fails does not stop the next one.
set -u
OUT=${OUT:-$PWD/gpu_issue16_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }

stamp "build"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1 \
  || { tail -40 "$OUT/build.log"; exit 1; }

stamp "probe: the mapped ring and its pointer form"
timeout 40 python3 - > "$OUT/probe.log" 2>&1 <<'EOF'
import threading
import torch
from zos.staging_ring import StagingRing
# Nothing has touched CUDA in this process yet, and the second ring is made on a fresh
# thread (a serving loop's background thread): the ring makes its device's context current.
ring = StagingRing(4, 1024, torch.device("cuda"))
print("device_view:", type(ring.device_view).__name__, "device_ptr:", hex(ring.fences.device_ptr),
      "host_ptr:", hex(ring.fences.host_ptr))
out = {}
def on_thread():
    try:
        r = StagingRing(2, 64, torch.device("cuda"))
        r.acquire(0); r.commit(); r.synchronize()
        out["ok"] = type(r.device_view).__name__
    except Exception as e:  # reported below
        out["error"] = repr(e)
t = threading.Thread(target=on_thread); t.start(); t.join()
print("fresh thread:", out)
EOF
echo "probe rc=$?"; cat "$OUT/probe.log"

stamp "prep, staging and backend tests on CUDA (stalled-stream tests included)"
PREP_FILES=(tests/test_staging.py tests/test_staging_ring.py tests/test_backends.py
            tests/test_spec_backends.py tests/test_padding.py)
timeout 100 python3 -m pytest -q -p no:cacheprovider "${PREP_FILES[@]}" > "$OUT/tests.log" 2>&1
echo "tests rc=$?"; tail -15 "$OUT/tests.log"

if [ "${SUITE:-1}" = 1 ]; then
stamp "the rest of the suite on CUDA (less test_distributed.py)"
REST=()
for f in tests/test_*.py; do
  case " ${PREP_FILES[*]} tests/test_distributed.py " in *" $f "*) ;; *) REST+=("$f");; esac
done
timeout 110 python3 -m pytest -q -p no:cacheprovider "${REST[@]}" > "$OUT/suite.log" 2>&1
echo "suite rc=$?"; tail -8 "$OUT/suite.log"
fi

SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  for tool in memcheck racecheck; do
    stamp "compute-sanitizer $tool"
    timeout 60 "$SAN" --tool "$tool" --error-exitcode 9 \
      python3 -m pytest -q -x -p no:cacheprovider \
      "tests/test_staging_ring.py::test_ring_build_without_new_record_and_empty_step" \
      "tests/test_staging_ring.py::test_sparse_and_dense_records_build_identical_buffers[0]" \
      > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$OUT/$tool.log" | tail -4
  done
else
  echo "compute-sanitizer not found" | tee "$OUT/memcheck.log" "$OUT/racecheck.log"
fi

stamp "bench_prep"
timeout 120 python3 bench/bench_prep.py --sizes 1,8,64,256,512,1024 --steps 150 --warmup 20 \
  --profiled 10 --variants host,zos-graph,zos-graph-copy --check-steps --out "$OUT" \
  > "$OUT/bench_prep.log" 2>&1
echo "bench_prep rc=$?"; tail -30 "$OUT/bench_prep.log"

stamp "host_breakdown"
timeout 40 python3 bench/host_breakdown.py --sizes 1,64,256,1024 --steps 150 --out "$OUT" \
  > "$OUT/breakdown.log" 2>&1
echo "breakdown rc=$?"; cat "$OUT/breakdown.log"
stamp "done"
