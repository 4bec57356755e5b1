# Q1b: what happens with no Vulkan driver. Run with VK_ICD_FILENAMES=/nonexistent.json (hides lavapipe)
import os, wgpu, traceback
print("env:", {k: os.environ.get(k) for k in ("VK_ICD_FILENAMES", "WGPU_BACKEND_TYPE")})
ads = wgpu.gpu.enumerate_adapters_sync()
print("adapters:", [(a.info["device"], a.info["backend_type"]) for a in ads])
print("vulkan adapters:", [a.summary for a in ads if a.info["backend_type"] == "Vulkan"])
try:
    a = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    print("request_adapter_sync ->", a.summary)
except Exception as e:
    print("request_adapter_sync raised", type(e).__module__, type(e).__qualname__, "MRO", [c.__name__ for c in type(e).__mro__], "msg:", repr(str(e)))
