"""Builds the native core ``zos._C`` (plain C++17, no CUDA toolkit needed)."""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext_modules = [
    Pybind11Extension(
        "zos._C",
        ["csrc/bindings.cpp", "csrc/remap.cpp", "csrc/packer.cpp", "csrc/upload.cpp",
         "csrc/vllm_mirror.cpp"],
        include_dirs=["csrc"],
        cxx_std=17,
        extra_compile_args=["-O3"],
        libraries=["dl"],
    ),
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
