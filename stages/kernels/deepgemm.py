"""DeepGEMM (https://github.com/deepseek-ai/DeepGEMM), loaded once for the backends that call
it (deepgemm_moe). It is not on the package index: it is built from its source
against the local torch and CUDA (`.gpu-deepgemm/deepgemm_build.sh` does it on our GPU host) and
JIT-compiles its kernels at first use. The backends here take its SM90 kernels only (fp32
scales; SM100's take other layouts)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch


@functools.lru_cache(maxsize=1)
def load() -> Any:
    return importlib.import_module("deep_gemm")


def sm90_loaded(device: str) -> bool:
    """The device is an SM90 GPU and deep_gemm imports."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability()[0] != 9:
        return False
    try:
        load()
    except ImportError:  # not built here
        return False
    return True
