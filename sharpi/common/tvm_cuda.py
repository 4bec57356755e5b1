"""Loading TVM's CUDA runtime library (libtvm_runtime_cuda), which registers the CUDA device API and the CUDA
module loader. `import tvm` loads it only when TVM's compiler library is present; the runtime-only TVM a GPU
machine may carry (TVM_USE_RUNTIME_LIB=1, no libtvm_compiler.so) does not, so both the compiler (to embed
kernels) and the runtime (to run them) call this."""
from __future__ import annotations

import ctypes
from pathlib import Path


def load_tvm_cuda_runtime(driver: str | Path = "libcuda.so.1") -> None:
    """Load the NVIDIA driver library `driver`, then libtvm_runtime_cuda beside libtvm_runtime; idempotent.
    Raises OSError naming what could not be loaded."""
    from tvm.base import _LOADED_LIBS
    from tvm_ffi.libinfo import load_lib_ctypes

    if "tvm_runtime_cuda" in _LOADED_LIBS:
        return
    ctypes.CDLL(str(driver), mode=ctypes.RTLD_GLOBAL)
    runtime_dir = Path(_LOADED_LIBS["tvm_runtime"]._name).resolve().parent
    try:
        _LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(package="tvm", target_name="tvm_runtime_cuda",
                                                           extra_lib_paths=[runtime_dir], mode="RTLD_LOCAL")
    except (RuntimeError, FileNotFoundError) as exc:
        raise OSError(f"TVM's CUDA runtime library could not be loaded: {exc}") from None
