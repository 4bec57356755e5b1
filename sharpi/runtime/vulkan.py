"""Running a Vulkan plan (sharpi.codegen.vulkan) through wgpu: device selection, persistent buffers, and one
command encoder per call in which every kernel of the plan is dispatched; only the result is read back."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.errors import ArtifactError, SharpiError
from ..common.shape_expr import evaluate

UNIFORM_STRIDE = 256      # minUniformBufferOffsetAlignment on lavapipe and most GPUs
MAX_GRID_X = 65535


class VulkanUnavailableError(SharpiError):
    """No Vulkan device (or the wgpu package) is available."""


_INSTANCE_READY: list[bool] = []   # wgpu's instance is created once per process; configure it before that


def _wgpu():
    try:
        import wgpu
        import wgpu.backends.wgpu_native.extras as extras
    except ImportError:
        raise VulkanUnavailableError("The Vulkan backend needs the wgpu package: pip install 'sharpi[vulkan]'.") from None
    if not _INSTANCE_READY:
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


@dataclass
class DeviceTensor:
    buffer: object
    offset: int
    shape: tuple
    dtype: str

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


class VulkanPlanRunner:
    """Loads plan.json + WGSL from a directory and runs its functions on one Vulkan device."""

    def __init__(self, directory, adapter_name: str | None = None):
        self.directory = Path(directory)
        try:
            self.plan = json.loads((self.directory / "plan.json").read_text())
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{self.directory} has no readable plan.json: {exc}.") from None
        need_f16 = any(b["dtype"] == "float16" for k in self.plan["kernels"].values() for b in k["buffers"])
        self.adapter, self.device = open_device(adapter_name, need_f16)
        self._wgpu = _wgpu()
        self._pipelines = {name: self._pipeline(k) for name, k in self.plan["kernels"].items()}
        self._uniforms = None

    @property
    def adapter_name(self) -> str:
        return self.adapter.info["device"]

    def _pipeline(self, kernel: dict):
        wgpu, dev = self._wgpu, self.device
        stage = wgpu.ShaderStage.COMPUTE
        entries = [{"binding": i, "visibility": stage,
                    "buffer": {"type": "storage" if b["access"] == "read_write" else "read-only-storage"}}
                   for i, b in enumerate(kernel["buffers"])]
        entries.append({"binding": len(kernel["buffers"]), "visibility": stage, "buffer": {"type": "uniform"}})
        layout = dev.create_bind_group_layout(entries=entries)   # explicit: "auto" drops unused bindings
        shader = dev.create_shader_module(code=(self.directory / kernel["wgsl"]).read_text())
        pipeline = dev.create_compute_pipeline(layout=dev.create_pipeline_layout(bind_group_layouts=[layout]),
                                               compute={"module": shader, "entry_point": kernel["entry"]})
        return pipeline, layout

    # -- buffers ----------------------------------------------------------------------------------------------
    def buffer(self, nbytes: int):
        usage = self._wgpu.BufferUsage
        return self.device.create_buffer(size=max(4, (nbytes + 3) // 4 * 4),
                                         usage=usage.STORAGE | usage.COPY_SRC | usage.COPY_DST)

    def upload(self, array: np.ndarray) -> DeviceTensor:
        array = np.ascontiguousarray(array)
        buf = self.buffer(array.nbytes)
        self.device.queue.write_buffer(buf, 0, array)
        return DeviceTensor(buf, 0, array.shape, str(array.dtype))

    def download(self, t: DeviceTensor) -> np.ndarray:
        raw = self.device.queue.read_buffer(t.buffer, t.offset, t.nbytes)
        return np.frombuffer(raw, t.dtype).reshape(t.shape).copy()

    # -- running ----------------------------------------------------------------------------------------------
    def run(self, function: str, *inputs) -> np.ndarray:
        """Run a planned function on numpy arrays or DeviceTensors; returns the output as numpy."""
        tensors = [x if isinstance(x, DeviceTensor) else self.upload(np.asarray(x)) for x in inputs]
        dispatches, output = self._record(self.plan["functions"][function], tensors)
        self.device.queue.submit([self._encode(dispatches)])
        return self.download(output)

    def _record(self, fplan: dict, tensors: list[DeviceTensor]):
        if len(tensors) != len(fplan["inputs"]):
            raise SharpiError(f"Expected {len(fplan['inputs'])} inputs, got {len(tensors)}.")
        env = {name: tensors[i].shape[j] for name, (i, j) in fplan["sym_vars"].items()}
        values = {spec["name"]: t for spec, t in zip(fplan["inputs"], tensors)}
        storages, dispatches = {}, []
        for op in fplan["ops"]:
            kind = op["op"]
            if kind == "alloc_storage":
                storages[op["out"]] = self.buffer(evaluate(op["nbytes"], env))
            elif kind == "alloc_tensor":
                values[op["out"]] = DeviceTensor(storages[op["storage"]], evaluate(op["offset"], env),
                                                 tuple(evaluate(d, env) for d in op["shape"]), op["dtype"])
            elif kind == "alias":
                values[op["out"]] = values[op["src"]]
            elif kind == "call":
                dispatches += self._launches(op["func"], [values[a] for a in op["args"]])
            elif kind != "kill":          # storage lives as long as a tensor refers to it
                raise ArtifactError(f"Unknown plan op {kind!r}.")
        return dispatches, values[fplan["output"]]

    def _launches(self, func: str, args: list[DeviceTensor]) -> list:
        pf = self.plan["prim_funcs"][func]
        env = {}
        for dims, arg in zip(pf["param_shapes"], args):       # the PrimFunc binds its own shape vars
            for dim, size in zip(dims, arg.shape):
                if dim.isidentifier():
                    env.setdefault(dim, size)
        for name, expr in pf["lets"].items():
            env[name] = evaluate(expr, env)
        out = []
        for launch in pf["launches"]:
            kernel = self.plan["kernels"][launch["kernel"]]
            extents = {tag: evaluate(e, env) for tag, e in launch["launch"].items()}
            grid = [extents.get(f"blockIdx.{c}", 1) for c in "xyz"]
            gx, gz = grid[0], 1
            while gx > MAX_GRID_X:           # TVM's WGSL unpacks blockIdx.x from x and z (as webgpu.ts packs it)
                gx, gz = (gx + 1) // 2, gz * 2
            pod = np.zeros(UNIFORM_STRIDE // 4, np.int32)
            for i, (field, expr) in enumerate(zip(kernel["pod"], launch["pod_args"])):
                value = evaluate(expr, env)
                pod.view(np.float32 if field["wgsl"] == "f32" else np.int32)[i] = value
            # the kernel exits when its packed block index is > packGridDimX
            pod.view(np.uint32)[len(kernel["pod"])] = grid[0] - 1 if gz > 1 else grid[0]
            out.append((launch["kernel"], [args[i] for i in launch["buffer_args"]], pod, (gx, grid[1], gz)))
        return out

    def _encode(self, dispatches):
        wgpu, dev = self._wgpu, self.device
        needed = max(len(dispatches), 64) * UNIFORM_STRIDE
        if self._uniforms is None or self._uniforms.size < needed:
            self._uniforms = dev.create_buffer(size=needed, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        if dispatches:
            dev.queue.write_buffer(self._uniforms, 0, np.concatenate([d[2] for d in dispatches]))
        encoder = dev.create_command_encoder()
        compute = encoder.begin_compute_pass()
        for i, (name, buffers, _, grid) in enumerate(dispatches):
            pipeline, layout = self._pipelines[name]
            entries = [{"binding": j, "resource": {"buffer": t.buffer, "offset": t.offset, "size": max(4, t.nbytes)}}
                       for j, t in enumerate(buffers)]
            entries.append({"binding": len(buffers),
                            "resource": {"buffer": self._uniforms, "offset": i * UNIFORM_STRIDE, "size": 16}})
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, dev.create_bind_group(layout=layout, entries=entries))
            compute.dispatch_workgroups(*grid)
        compute.end()
        return encoder.finish()
