"""Test set-up: fixtures and the hypothesis profiles (shared non-fixture helpers are in
helpers.py). Without a GPU, ``import zos`` makes Triton run its kernels in the CPU interpreter
(TRITON_INTERPRET=1); the same suite runs on a GPU (CUDA tensors, compiled kernels, CUDA graphs)
unchanged.

Hypothesis runs under the profile named by HYPOTHESIS_PROFILE, default "ci": derandomized (the
same examples on every run and machine), no example database, no deadline (the Triton
interpreter is slow and uneven); each test sets its own max_examples. HYPOTHESIS_PROFILE=default
draws fresh examples on every run (and keeps failures in .hypothesis/).
"""
import zos._interpret  # noqa: F401  (before anything imports triton)

import gc
import os

import pytest
from hypothesis import settings

from zos.serving.models import random_llama

from helpers import DEVICE, LLAMA_CFG

settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(scope="session")
def llama():
    """The small random Llama of helpers.LLAMA_CFG (seed 0), shared by the engine and runner
    tests; nothing in them changes its weights."""
    return random_llama(LLAMA_CFG, seed=0, device=DEVICE)


@pytest.fixture
def collector_on():
    """Python's garbage collector enabled for the test, its state restored after."""
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``-v``, a failure's report is printed as it happens, not only in the summary: the
    CUDA suite runs for minutes in one process (bench/gpu_check.sh), and a later abort or
    time limit would lose the summary, and with it the first failure's cause."""
    report = (yield).get_result()
    if report.failed and item.config.getoption("verbose") > 0:
        print(f"\n---- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n",
              flush=True)
