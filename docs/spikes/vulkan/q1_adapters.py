# Q1: list wgpu adapters, pick lavapipe (Vulkan CPU), show features/limits
import wgpu, sys
import wgpu.backends.wgpu_native as wn
print("wgpu", wgpu.__version__, "wgpu-native", wn.__version__)
ads = wgpu.gpu.enumerate_adapters_sync()
for a in ads:
    i = a.info
    print(f"- {i['device']!r} backend={i['backend_type']} type={i['adapter_type']} vendor={i['vendor']} desc={i['description']!r}")
    print("  shader-f16:", "shader-f16" in a.features, "| features:", sorted(a.features))
    L = a.limits
    print("  limits:", {k: L[k] for k in ("max-storage-buffers-per-shader-stage","max-storage-buffer-binding-size","max-buffer-size",
          "max-compute-workgroup-size-x","max-compute-invocations-per-workgroup","max-compute-workgroup-storage-size","max-compute-workgroups-per-dimension")})
lvp = [a for a in ads if a.info["backend_type"] == "Vulkan" and "llvmpipe" in a.info["device"].lower()]
print("picked:", lvp[0].summary if lvp else None)
dev = lvp[0].request_device_sync(required_features=["shader-f16"])
print("device ok", dev)
