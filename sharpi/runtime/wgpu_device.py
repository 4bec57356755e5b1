"""Vulkan devices through wgpu: the instance (Vulkan only), the adapters, and opening the chosen one."""
from __future__ import annotations

from ..common.errors import SharpiError


class VulkanUnavailableError(SharpiError):
    """No Vulkan device (or the wgpu package) is available."""


_INSTANCE_READY: list[bool] = []   # wgpu's instance is created once per process; configure it before that


def _wgpu():
    try:
        import wgpu
        import wgpu.backends.wgpu_native.extras as extras
    except ImportError:
        raise VulkanUnavailableError("The Vulkan backend needs the wgpu package: python -m pip install "
                                     "\".[vulkan]\" in the sharpi clone.") from None
    if not _INSTANCE_READY:
        import atexit
        import os
        import shutil
        import tempfile
        if not os.environ.get("XDG_RUNTIME_DIR"):
            # Mesa's drivers print "error: XDG_RUNTIME_DIR is invalid" without one (headless machines, CI);
            # a private empty directory is all they look for, and it goes with the process
            os.environ["XDG_RUNTIME_DIR"] = runtime_dir = tempfile.mkdtemp(prefix="sharpi-xdg-")
            atexit.register(shutil.rmtree, runtime_dir, ignore_errors=True)
        extras.set_instance_extras(backends=["Vulkan"])     # never fall back silently to an OpenGL adapter
        _INSTANCE_READY.append(True)
    return wgpu


def list_adapters() -> list[dict]:
    """The Vulkan adapters wgpu sees: name, type (DiscreteGPU, IntegratedGPU, CPU...), features."""
    wgpu = _wgpu()
    return [{"name": a.info["device"], "type": a.info["adapter_type"], "backend": a.info["backend_type"],
             "features": sorted(a.features), "adapter": a} for a in wgpu.gpu.enumerate_adapters_sync()]


_PREFERENCE = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}


def open_device(adapter_name: str | None = None, need_f16: bool = False):
    """The highest-performance Vulkan adapter (a discrete GPU before an integrated one before lavapipe), or the
    first whose name contains `adapter_name`; returns (adapter, device)."""
    adapters = list_adapters()
    if not adapters:
        raise VulkanUnavailableError("No Vulkan device found; install a Vulkan driver (on Debian or Ubuntu without "
                                     "a GPU: apt-get install mesa-vulkan-drivers libvulkan1).")
    if adapter_name is not None:
        adapters = [a for a in adapters if adapter_name.lower() in a["name"].lower()]
        if not adapters:
            names = ", ".join(a["name"] for a in list_adapters())
            raise VulkanUnavailableError(f"No Vulkan adapter matches {adapter_name!r}; adapters: {names}.")
    chosen = sorted(adapters, key=lambda a: _PREFERENCE.get(a["type"], 4))[0]
    adapter = chosen["adapter"]
    if need_f16 and "shader-f16" not in adapter.features:
        raise VulkanUnavailableError(f"{chosen['name']} lacks the shader-f16 feature this artifact needs.")
    limits = {k: adapter.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size",
                                              "max-storage-buffers-per-shader-stage")}
    device = adapter.request_device_sync(required_features=["shader-f16"] if need_f16 else [],
                                         required_limits=limits)
    return adapter, device
