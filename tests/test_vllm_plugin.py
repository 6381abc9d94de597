"""zos's vLLM plug-in entry point (zos/integrations/vllm_plugin.py) where vLLM is not needed:
it is registered under vLLM's plug-in group, does nothing (imports nothing of vLLM) unless
switched on, and refuses a flag it does not know before anything else. What it does inside vLLM
runs on a GPU only (bench/vllm_check.py: shadow comparison and greedy outputs)."""
import sys
from importlib.metadata import entry_points

import pytest

from zos.integrations import vllm_plugin


def test_registered_in_vllms_plugin_group():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "zos"]
    assert ep.load() is vllm_plugin.register


def test_off_by_default_and_imports_nothing_of_vllm(monkeypatch):
    for name in ("ZOS_VLLM", "ZOS_VLLM_SHADOW", "ZOS_VLLM_STATS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # any import of vLLM would raise
    vllm_plugin.register()
    monkeypatch.setenv("ZOS_VLLM", "0")
    vllm_plugin.register()


@pytest.mark.parametrize("name", ["ZOS_VLLM", "ZOS_VLLM_SHADOW"])
@pytest.mark.parametrize("value", ["true", "2", " 1", "on"])
def test_a_flag_other_than_0_or_1_is_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got {value!r}"):
        vllm_plugin.register()


def test_another_vllm_release_is_refused(monkeypatch):
    fake = type(sys)("vllm")
    fake.__version__ = "0.27.0"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("ZOS_VLLM", "1")
    with pytest.raises(RuntimeError, match="written against vLLM 0.26.0 .* found 0.27.0"):
        vllm_plugin.register()
