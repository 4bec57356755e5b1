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
STORAGE_ALIGNMENT = 256   # minStorageBufferOffsetAlignment (WebGPU's default limit)
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
    persistent: bool = False       # a weight: its bytes never change, so derived copies may be cached

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
        self._realigned: dict = {}

    @property
    def adapter_name(self) -> str:
        return self.adapter.info["device"]

    @property
    def max_binding_size(self) -> int:
        return int(self.device.limits["max-storage-buffer-binding-size"])

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

    def upload(self, array: np.ndarray, persistent: bool = False) -> DeviceTensor:
        """A new buffer holding `array`; persistent marks weights (never written by kernels)."""
        array = np.ascontiguousarray(array)
        buf = self.buffer(array.nbytes)
        self.device.queue.write_buffer(buf, 0, array)
        return DeviceTensor(buf, 0, array.shape, str(array.dtype), persistent)

    def download(self, t: DeviceTensor) -> np.ndarray:
        raw = self.device.queue.read_buffer(t.buffer, t.offset, t.nbytes)
        return np.frombuffer(raw, t.dtype).reshape(t.shape).copy()

    # -- running ----------------------------------------------------------------------------------------------
    def run(self, function: str, *inputs):
        """Run a planned function on numpy arrays or DeviceTensors (a list for a tuple input); returns the output
        as numpy (a list for a tuple output)."""
        return self._to_numpy(self.run_on_device(function, *inputs))

    def _to_numpy(self, value):
        if isinstance(value, list):
            return [self._to_numpy(v) for v in value]
        return self.download(value)

    def run_on_device(self, function: str, *inputs):
        """Run a planned function; the output stays on the device (DeviceTensor, or a list for a tuple).
        All its kernels go into one command encoder and one submit."""
        tensors = [self._as_device(x) for x in inputs]
        dispatches, output = self._record(self.plan["functions"][function], tensors)
        self.device.queue.submit([self._encode(dispatches)])
        return output

    def _as_device(self, x):
        if isinstance(x, (list, tuple)):
            return [self._as_device(v) for v in x]
        return x if isinstance(x, DeviceTensor) else self.upload(np.asarray(x))

    def _record(self, fplan: dict, tensors: list):
        if len(tensors) != len(fplan["inputs"]):
            raise SharpiError(f"Expected {len(fplan['inputs'])} inputs, got {len(tensors)}.")
        env = {}
        for name, path in fplan["sym_vars"].items():
            value = tensors
            for i in path[:-1]:
                value = value[i]
            env[name] = value.shape[path[-1]]
        values = {spec["name"]: t for spec, t in zip(fplan["inputs"], tensors)}
        dispatches = []
        for op in fplan["ops"]:
            kind = op["op"]
            if kind == "alloc_storage":
                values[op["out"]] = DeviceTensor(self.buffer(evaluate(op["nbytes"], env)), 0, (0,), "uint8")
            elif kind == "alloc_tensor":
                storage = values[op["storage"]]
                values[op["out"]] = DeviceTensor(storage.buffer, evaluate(op["offset"], env),
                                                 tuple(evaluate(d, env) for d in op["shape"]), op["dtype"])
            elif kind == "view":
                src = values[op["src"]]
                values[op["out"]] = DeviceTensor(src.buffer, src.offset + evaluate(op["byte_offset"], env),
                                                 tuple(evaluate(d, env) for d in op["shape"]),
                                                 op["dtype"] or src.dtype, src.persistent)
            elif kind == "alias":
                values[op["out"]] = values[op["src"]]
            elif kind == "get_item":
                values[op["out"]] = values[op["src"]][op["index"]]
            elif kind == "tuple":
                values[op["out"]] = [values[f] for f in op["fields"]]
            elif kind == "call":
                args = [values[a["var"]] if "var" in a else a["const"] for a in op["args"]]
                dispatches += self._launches(op["func"], args)
            else:
                raise ArtifactError(f"Unknown plan op {kind!r}.")
        return dispatches, values[fplan["output"]]

    def _launches(self, func: str, args: list) -> list:
        pf = self.plan["prim_funcs"][func]
        env = {}
        for name, dims, arg in zip(pf["params"], pf["param_shapes"], args):   # the PrimFunc binds its own vars
            if dims is None:                       # a scalar parameter, passed by value
                env[name] = arg
                continue
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
            buffers = [self._bindable(args[i]) for i in launch["buffer_args"]]
            out.append((launch["kernel"], buffers, pod, (gx, grid[1], gz)))
        return out

    def _bindable(self, t: DeviceTensor) -> DeviceTensor:
        """A tensor a bind group can take: storage bindings start at multiples of 256 bytes, so a view of a
        weight at another offset (a scale plane whose size is not a multiple of 64 words) is copied once into a
        buffer of its own and cached."""
        if t.offset % STORAGE_ALIGNMENT == 0:
            return t
        if not t.persistent:
            raise ArtifactError(f"A kernel argument starts at byte {t.offset}, not a multiple of "
                                f"{STORAGE_ALIGNMENT}; only weights may be realigned.")
        key = (id(t.buffer), t.offset, t.nbytes)
        if key not in self._realigned:
            copy = self.buffer(t.nbytes)
            encoder = self.device.create_command_encoder()
            encoder.copy_buffer_to_buffer(t.buffer, t.offset, copy, 0, (t.nbytes + 3) // 4 * 4)
            self.device.queue.submit([encoder.finish()])
            self._realigned[key] = DeviceTensor(copy, 0, t.shape, t.dtype, True)
        return self._realigned[key]

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
                            "resource": {"buffer": self._uniforms, "offset": i * UNIFORM_STRIDE, "size": UNIFORM_STRIDE}})
            compute.set_pipeline(pipeline)
            compute.set_bind_group(0, dev.create_bind_group(layout=layout, entries=entries))
            compute.dispatch_workgroups(*grid)
        compute.end()
        return encoder.finish()


class VulkanBackend:
    """A Vulkan artifact on one adapter: weights and the KV page pool live in device buffers; each forward is
    one command encoder and one submit; only logits and keep sets are read back."""
    kind = "vulkan"

    def __init__(self, directory: Path, manifest, verify: bool = True, adapter: str | None = None):
        import os

        from .loader import check_artifact

        check_artifact(directory, manifest, verify_hashes=verify)
        self.runner = VulkanPlanRunner(directory, adapter or os.environ.get("SHARPI_VULKAN_ADAPTER") or None)
        info = self.runner.adapter.info
        self.description = f"Vulkan: {info['device']} ({info['adapter_type']})"
        self.functions = set(manifest.functions) & set(self.runner.plan["functions"])
        self.weights = self._upload_weights(directory, manifest)
        self.pool: DeviceTensor | None = None

    def _upload_weights(self, directory: Path, manifest) -> list[DeviceTensor]:
        from ..common.manifest import WEIGHTS

        limit = self.runner.max_binding_size
        size = (directory / WEIGHTS).stat().st_size
        mapped = np.memmap(directory / WEIGHTS, dtype=np.uint8, mode="r", shape=(size,))
        tensors = []
        try:
            for p in manifest.params:
                if p.offset + p.nbytes > size:
                    raise ArtifactError(f"{directory}/{WEIGHTS} is truncated ({p.name} ends past the file).")
                if p.nbytes > limit:
                    raise VulkanUnavailableError(f"{p.name} takes {p.nbytes >> 20} MiB, more than the "
                                                 f"{limit >> 20} MiB a storage buffer of {self.runner.adapter_name} "
                                                 f"may bind.")
                array = mapped[p.offset:p.offset + p.nbytes].view(np.dtype(p.dtype)).reshape(p.shape)
                tensors.append(self.runner.upload(array, persistent=True))
        finally:
            del mapped
        return tensors

    # -- the KV page pool -------------------------------------------------------------------------------------
    def allocate_pool(self, shape: tuple) -> int:
        """One buffer [pages, 2, kv_heads, page_size, head_dim], capped at the adapter's storage-binding limit
        (128 MiB on lavapipe); returns the page count it holds."""
        page_bytes = 4 * int(np.prod(shape[1:]))
        pages = max(1, min(int(shape[0]), self.runner.max_binding_size // page_bytes))
        shape = (pages, *shape[1:])
        self.pool = DeviceTensor(self.runner.buffer(pages * page_bytes), 0, shape, "float32")
        self._page_bytes = page_bytes
        return pages

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        encoder = self.runner.device.create_command_encoder()
        for s, d in zip(src, dst):
            encoder.copy_buffer_to_buffer(self.pool.buffer, s * self._page_bytes, self.pool.buffer,
                                          d * self._page_bytes, self._page_bytes)
        self.runner.device.queue.submit([encoder.finish()])

    def read_pages(self, pages: list[int]) -> np.ndarray:
        queue, shape = self.runner.device.queue, self.pool.shape[1:]
        return np.stack([np.frombuffer(queue.read_buffer(self.pool.buffer, p * self._page_bytes, self._page_bytes),
                                       np.float32).reshape(shape) for p in pages])

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        for p, page in zip(pages, data):
            self.runner.device.queue.write_buffer(self.pool.buffer, p * self._page_bytes,
                                                  np.ascontiguousarray(page, np.float32))

    # -- calls ------------------------------------------------------------------------------------------------
    def forward(self, function: str, ids, positions, page_table, kv_lens, extra: tuple = ()):
        out = self.runner.run_on_device(function, ids, positions, self.pool, page_table, kv_lens, self.weights,
                                        *extra)
        if function == "prefill_snapkv":
            return self.runner.download(out[0]), out[1]
        return self.runner.download(out)

    def select(self, scores: DeviceTensor, params: np.ndarray):
        keep = self.runner.run_on_device("snapkv_select", scores, params)
        return keep, self.runner.download(keep)

    def compact(self, page_table: np.ndarray, keep, count: int) -> None:
        self.runner.run_on_device("snapkv_compact", self.pool, page_table, keep, np.array([count], np.int32))
