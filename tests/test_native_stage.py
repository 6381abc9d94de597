"""zos._C's driver paths on a CPU, on every CI run: ``StepPacker.stage_call`` over a
``MappedRing`` and a ``PinnedUpload`` against a fake CUDA driver (``tests/fake_cuda/``: host
memory as device memory, every call done at once, faults set by the scenario), compiled here
and found first by the loader of a subprocess. It checks zos's bookkeeping around the driver
(records and slots, launches on the bound stream, the capture refusal, the packer's reset on a
device error and only then, the argument checks); CUDA's own behaviour is the GPU tests'
(``test_staging_ring.py``, ``test_backends.py``)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "fake_cuda"
SCENARIOS = ["ring_records_and_launches", "unbuilt_slot_resets_the_packer",
             "capturing_stream_is_refused_before_anything",
             "launch_error_resets_the_packer_and_keeps_the_slot", "packer_error_changes_nothing",
             "upload_records_copies_and_errors", "arguments_are_checked_first",
             "gil_released_only_around_a_wait", "event_calls_leave_another_threads_capture_alone",
             "teardown_inside_own_capture", "relaxed_call_inside_own_capture"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake driver")
    lib = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib / "libcuda.so.1"),
                    str(HERE / "fake_libcuda.c"), "-ldl"], check=True)
    # the checkout's zos first (an editable install elsewhere would be found otherwise)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parents[1]),
                                                        os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, str(HERE / "stage_checks.py"), *SCENARIOS], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_native_stage_against_a_fake_driver(results, scenario):
    assert results[scenario] == "ok", results[scenario]
