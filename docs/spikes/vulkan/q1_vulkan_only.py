# Q1c: restrict wgpu-native to Vulkan before any adapter call (avoids the GL/EGL probe and silent GL fallback)
import wgpu, wgpu.backends.wgpu_native.extras as wx
wx.set_instance_extras(backends=["Vulkan"])
ads = wgpu.gpu.enumerate_adapters_sync()
print("adapters:", [a.summary for a in ads])
if not ads:
    raise SystemExit("SharpiError: no Vulkan adapter (install mesa-vulkan-drivers libvulkan1 or a GPU driver)")
