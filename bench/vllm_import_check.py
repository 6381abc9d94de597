"""Import what vLLM needs to build `vllm.LLM(model=DIR)` for a dense Llama and to `vllm serve` it.

Run on the GPU machine once bench/vllm_bundle.sh --install has filled /tmp/vllm_site:
    PYTHONPATH=/tmp/vllm_site VLLM_USE_FLASHINFER_SAMPLER=0 python3 bench/vllm_import_check.py
Prints vLLM's version, one line per module (ok / FAIL and why), and the missing module names;
exits 1 if any import failed. On a CPU, the CUDA pieces (vllm._C_stable_libtorch, FA3) fail.
"""
import importlib
import os
import sys
import traceback

# Third-party packages vLLM imports on the way (carried as wheels or on the GPU machine already).
DEPS = ["torch", "triton", "transformers", "numba", "pydantic", "fastapi", "starlette", "uvicorn",
        "msgspec", "zmq", "cbor2", "pybase64", "cachetools", "blake3", "openai", "openai_harmony",
        "xgrammar", "llguidance", "outlines_core", "lmformatenforcer", "partial_json_parser",
        "tvm_ffi", "compressed_tensors", "depyf", "mistral_common", "prometheus_client",
        "prometheus_fastapi_instrumentator", "anthropic", "model_hosting_container_standards",
        "setproctitle", "ijson", "watchfiles", "jsonschema", "lark", "nvtx", "multipart"]
# vLLM's own modules on the path of LLM(...) -> engine core -> GPU worker -> Llama + FlashAttention,
# and of `vllm serve` (the OpenAI server and its CLI).
VLLM = ["vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
        "vllm.v1.engine.core_client", "vllm.v1.executor.uniproc_executor",
        "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
        "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
        "vllm.v1.core.sched.scheduler", "vllm.distributed.parallel_state",
        "vllm.compilation.backends", "vllm.compilation.wrapper", "vllm.tokenizers.hf",
        "vllm.model_executor.model_loader.default_loader", "vllm.model_executor.models.llama",
        "vllm.model_executor.layers.rotary_embedding", "vllm.model_executor.layers.layernorm",
        "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.fa_utils",
        "vllm.v1.sample.sampler", "vllm.v1.structured_output.backend_xgrammar",
        "vllm.v1.structured_output.backend_guidance", "vllm.entrypoints.openai.api_server",
        "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve",
        # CUDA-only: these need a GPU machine's libraries (libcuda.so.1).
        "vllm.platforms.cuda", "vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C"]

def main() -> int:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    missing, failed = set(), []
    for name in DEPS + VLLM:
        try:
            mod = importlib.import_module(name)
            ver = getattr(mod, "__version__", "")
            print(f"ok    {name} {ver if isinstance(ver, str) else ''}")
        except ModuleNotFoundError as e:
            missing.add(e.name)
            failed.append(name)
            print(f"FAIL  {name}: {e}")
        except Exception as e:  # CUDA libraries, version checks, ...
            failed.append(name)
            last = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{last.filename}:{last.lineno}"
            print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:300]} [{where}]")

    if "vllm.vllm_flash_attn._vllm_fa3_C" not in failed:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
        print("FA3 available:", fa.FA3_AVAILABLE, fa.FA3_UNAVAILABLE_REASON or "")
    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = make_arg_parser(FlexibleArgumentParser())
        args = parser.parse_args(["--model", "m", "--port", "8000"])
        print("ok    serve arguments parse: model", args.model)
    except Exception as e:
        failed.append("serve-args")
        print(f"FAIL  serve arguments: {type(e).__name__}: {e}")

    print("missing modules:", " ".join(sorted(m for m in missing if m)) or "none")
    print(f"{len(failed)} of {len(DEPS) + len(VLLM)} imports failed: {' '.join(failed) or '-'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
