"""Builds the C++ sample-index helper; everything else lives in pyproject.toml.

The extension is optional: without a compiler the numpy fallback in
megatron/data/index_helpers.py computes identical indices, only slower.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "megatron.data._index_helpers_cpp",
            ["megatron/data/index_helpers.cpp"],
            cxx_std=17,
            extra_compile_args=["-O3"],
            optional=True,
        )
    ]
)
