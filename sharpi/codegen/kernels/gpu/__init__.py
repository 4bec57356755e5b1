"""Kernels for GPU targets (Vulkan via WGSL, CUDA): computations written so TVM's dlight GPU rules schedule them,
or scheduled here with thread bindings where no rule fits. CPU schedules live one folder up."""
