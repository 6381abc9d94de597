#!/usr/bin/env bash
# A slim vLLM 0.26.0 (+ the wheels it needs that the GPU machine lacks) to carry to the offline
# GPU machine (Python 3.12, torch 2.11.0+cu130, triton 3.6, transformers 5.17.0: KINDS.md's list).
# Build it here, on any x86-64 Linux with internet and pip (no GPU needed):
#   bash bench/vllm_bundle.sh [DIR]            # DIR defaults to .vllm_bundle (ignored by git)
# It writes DIR/vllm-slim.tar.xz.partKofN (each < 60 MiB; N = 2 today), DIR/vllm-slim.tar.xz.sha256
# and DIR/wheels/*.whl (56 wheels, ~40 MiB), and prints the sizes and what each device call carries.
# Dropped from the wheel: FA2 (_vllm_fa2_C, 305 MB: Hopper uses FA3, which is kept), _moe_C (MoE
# only; vLLM imports it under suppress(ImportError)), the Rust frontend vllm-rs (used only with
# VLLM_USE_RUST_FRONTEND=1), vendored DeepGEMM and fmha_sm100 (FP8 / SM100 / MiniMax only, their
# CUTLASS headers). Not carried: flashinfer, tilelang, cutlass-dsl, quack, torchcodec and the
# other CUDA kernel packages vLLM imports lazily; mcp and the OpenTelemetry exporters (tool servers,
# tracing). So set VLLM_USE_FLASHINFER_SAMPLER=0 and keep the attention backend FLASH_ATTN.
#
# On the device (each call <= 64 MiB carried; the repository itself is ~4 MB). /tmp lives only
# while the machine stays warm (30 s after a call), so make the calls back to back (done so on
# an H100, 2026-12-06: install ~40 s, then bench/vllm_check.py and vllm serve ran):
#   call 1: carry [DIR/vllm-slim.tar.xz.part1of2]
#           command: mkdir -p /tmp/vllm_parts && cp -r DIR/. /tmp/vllm_parts/
#   call 2: carry [DIR/vllm-slim.tar.xz.part2of2, DIR/vllm-slim.tar.xz.sha256, DIR/wheels]
#           command: bash bench/vllm_bundle.sh --install DIR && <your vLLM run, as in call 3>
#   call 3 (or the rest of call 2), while the machine is warm:
#           PYTHONPATH=/tmp/vllm_site VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/vllm_import_check.py
#           (then vllm.LLM(...) or `python3 -m vllm.entrypoints.cli.main serve MODEL ...`:
#           the tarball installs no `vllm` console script)
# `--install DIR` copies DIR's carry to /tmp/vllm_parts too, cats the parts there into
# /tmp/vllm-slim.tar.xz, checks it with sha256sum -c, untars it into /tmp/vllm_site, then runs
#   python3 -m pip install --no-index --no-deps --target /tmp/vllm_site /tmp/vllm_parts/wheels/*.whl
# If the script prints that the wheels fit beside part 1, carry DIR/wheels in call 1 instead.
#
# PYVER=3.11 WHEELS_ONLY=1 bash bench/vllm_bundle.sh DIR fetches the same wheels for Python 3.11
# (for bench/vllm_import_check.py on a CPU here, against torch CPU).
set -euo pipefail

if [[ ${1:-} == --install ]]; then          # run on the GPU machine (call 2 or 3)
  DIR=${2:-.vllm_bundle}; SITE=${SITE:-/tmp/vllm_site}; T=/tmp/vllm_parts
  mkdir -p $T && cp -r "$DIR"/. $T/          # this call's carry joins the earlier calls' in /tmp
  f=$(ls $T/vllm-slim.tar.xz.part*of* | head -1); n=${f##*of}
  for k in $(seq 1 "$n"); do cat $T/vllm-slim.tar.xz.part${k}of$n; done > /tmp/vllm-slim.tar.xz
  (cd /tmp && sha256sum -c) < $T/vllm-slim.tar.xz.sha256
  rm -rf "$SITE" && mkdir -p "$SITE" && tar -C "$SITE" -xJf /tmp/vllm-slim.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    $T/wheels/*.whl
  echo "installed into $SITE: PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 python3 ..."
  exit 0
fi

DIR=${1:-.vllm_bundle}
PYVER=${PYVER:-3.12}
VLLM_WHL=${VLLM_WHL:-/tmp/vllmwhl/vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl}
PART=${PART:-58M}                          # split size (MiB); each carried part must stay < 60 MiB
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
         --implementation cp "${PLAT[@]}" "$@" 2>&1 | { grep -v 'is ignored' || true; }; }
mkdir -p "$DIR/wheels"

# What vLLM 0.26.0's Requires-Dist (plus their own requirements) asks for and the GPU machine lacks,
# at versions that agree with each other and with vLLM's pins (apache-tvm-ffi==0.1.10 rules out
# xgrammar >= 0.2.8; pycountry: mistral-common, which transformers loads, needs it). The GPU
# machine has typing-extensions, anyio and idna at versions not read there; pydantic 2.14 needs
# typing-extensions >= 4.16, httpx2 needs idna >= 3.18 and anyio >= 4.10: carried.
# Skipped though vLLM lists them: the GPU machine's own torch/torchvision/torchaudio, triton,
# numba (vLLM pins 0.65.0), transformers, tokenizers, safetensors, numpy, protobuf, aiohttp, pillow,
# tiktoken, opencv, prometheus-client, ... (present), and the lazily imported ones named above.
WHEELS=(
  cachetools==8.0.2 blake3==1.0.11 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0
  python-multipart==0.0.34 prometheus-fastapi-instrumentator==8.1.0 watchfiles==1.3.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0 idna==3.21 sniffio==1.3.1
  openai==3.63.0 anthropic==2.17.0 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5
  jiter==0.19.0 docstring-parser==0.18.0 opentelemetry-api==1.45.3 openai-harmony==0.0.8
  msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 ijson==3.6.0 setproctitle==1.3.8
  python-json-logger==4.2.0 partial-json-parser==0.2.1.1.post7 nvtx==0.2.15
  xgrammar==0.2.7 apache-tvm-ffi==0.1.10 llguidance==1.7.6 outlines-core==0.2.14 lark==1.2.2
  lm-format-enforcer==0.11.3 interegular==0.3.3
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  mistral-common==1.13.1 pydantic-extra-types==2.11.1 pycountry==26.2.16
  compressed-tensors==0.17.0 loguru==0.7.3
  depyf==0.20.0 astor==0.8.1 dill==0.4.1
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
)
dl -d "$DIR/wheels" "${WHEELS[@]}"
# One version of each: a stale wheel from an earlier run with other pins would break the install.
dups=$(ls "$DIR/wheels" | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[[ -z $dups ]] || { echo "two versions of: $dups (empty $DIR/wheels and rerun)" >&2; exit 1; }
[[ ${WHEELS_ONLY:-0} == 1 ]] && { du -sh "$DIR/wheels"; exit 0; }

# The slim vLLM tree: unzip the wheel, drop what a dense model on Hopper never loads, xz it, split.
[[ -f $VLLM_WHL ]] || { mkdir -p "$(dirname "$VLLM_WHL")"
  PYVER=3.12 dl -d "$(dirname "$VLLM_WHL")" vllm==0.26.0; }
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
unzip -q "$VLLM_WHL" -d "$STAGE"
rm -rf "$STAGE"/vllm/vllm_flash_attn/_vllm_fa2_C*.so "$STAGE"/vllm/_moe_C*.so "$STAGE"/vllm/vllm-rs \
       "$STAGE"/vllm/third_party/deep_gemm "$STAGE"/vllm/third_party/fmha_sm100
for keep in vllm/_C_stable_libtorch.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so; do
  [[ -f $STAGE/$keep ]] || { echo "missing $keep in the wheel" >&2; exit 1; }
done
echo "slim tree: $(du -sh "$STAGE" | cut -f1) (from $(du -h "$VLLM_WHL" | cut -f1) wheel)"
rm -f "$DIR"/vllm-slim.tar.xz*
tar -C "$STAGE" -cf - vllm vllm-0.26.0.dist-info | xz -9 -T0 > "$DIR/vllm-slim.tar.xz"
(cd "$DIR" && sha256sum vllm-slim.tar.xz > vllm-slim.tar.xz.sha256 &&
 split -b "$PART" -d -a 1 --numeric-suffixes=1 vllm-slim.tar.xz vllm-slim.tar.xz.part && rm vllm-slim.tar.xz)
n=$(ls "$DIR"/vllm-slim.tar.xz.part? | wc -l)
for f in "$DIR"/vllm-slim.tar.xz.part?; do mv "$f" "${f}of$n"; done

# Sizes and the carry of each call (the repository's own files add ~3 MB to every call).
mib() { du -cbL "$@" | tail -1 | awk '{printf "%.1f", $1/1048576}'; }
ls -l "$DIR"/vllm-slim.tar.xz.* && echo "wheels: $(ls "$DIR"/wheels | wc -l) files, $(mib "$DIR"/wheels) MiB"
p1=$(mib "$DIR"/vllm-slim.tar.xz.part1of$n); w=$(mib "$DIR"/wheels)
echo "total: $(mib "$DIR"/vllm-slim.tar.xz.* "$DIR"/wheels) MiB (tarball $(mib "$DIR"/vllm-slim.tar.xz.part*) MiB)"
if awk "BEGIN{exit !($p1 + $w + 4 < 64)}"; then
  echo "call 1 carries part1 ($p1 MiB) + wheels ($w MiB); later calls the other parts + sha256"
else
  echo "call 1 carries part1 ($p1 MiB); call 2 the other parts + sha256 + wheels ($w MiB)"
fi
