"""Running a Vulkan plan (sharpi.common.plan, written by sharpi.codegen.targets.vulkan) through wgpu: persistent
buffers, and one command encoder per call in which every kernel of the plan is dispatched; only the result is read
back. Calls can be recorded and replayed (bind groups and launch arguments built once), which is what makes a
decode step cheap on the host."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common.errors import ArtifactError, SharpiError
from ..common.plan import Plan
from ..common.shape_expr import evaluate
from .wgpu_device import _wgpu, open_device

UNIFORM_STRIDE = 256      # minUniformBufferOffsetAlignment on lavapipe and most GPUs
STORAGE_ALIGNMENT = 256   # minStorageBufferOffsetAlignment (WebGPU's default limit)
MAX_GRID_X = 65535
MAX_RECORDINGS = 8        # recorded calls kept per runner (the oldest is dropped)


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

    def __init__(self, directory, adapter_name: str | None = None, plan: Plan | None = None):
        self.directory = Path(directory)
        self.plan = Plan.read(self.directory) if plan is None else plan
        need_f16 = any(b["dtype"] == "float16" for k in self.plan.kernels.values() for b in k["buffers"])
        self.adapter, self.device = open_device(adapter_name, need_f16)
        self._wgpu = _wgpu()
        self._pipelines = {name: self._pipeline(k) for name, k in self.plan.kernels.items()}
        self._realigned: dict = {}
        self._recordings: dict = {}
        self._device_tuples: dict = {}        # id -> a tuple known to hold device tensors only (held: ids stay)

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

    def run_on_device(self, function: str, *inputs, reuse: bool = False):
        """Run a planned function; the output stays on the device (DeviceTensor, or a list for a tuple).
        All its kernels go into one command encoder and one submit.

        With reuse, the call's buffers, bind groups and launch arguments are recorded once per input signature
        (shapes of the numpy inputs, identity of the device ones; a tuple of device tensors, the weights, by its
        own identity) and replayed: new numpy inputs are written into the recorded input buffers, so a decode
        step costs a few small writes and the dispatches alone. The output buffer is then reused by the next call
        with the same signature: read it before that."""
        if not reuse:
            tensors = [self._as_device(x) for x in inputs]
            dispatches, output = self._record(self.plan.functions[function], tensors)
            recording = self._bind(dispatches, tensors, output)
        else:
            key = (function, _signature(inputs, self._is_device_tuple))
            recording = self._recordings.pop(key, None)
            if recording is None:
                tensors = [self._as_device(x) for x in inputs]
                dispatches, output = self._record(self.plan.functions[function], tensors)
                recording = self._bind(dispatches, tensors, output)
                recording.given = inputs
            else:
                self._write_inputs(recording.inputs, inputs, recording.given)
            self._recordings[key] = recording                # most recently used last
            while len(self._recordings) > MAX_RECORDINGS:
                self._recordings.pop(next(iter(self._recordings)))
        self.device.queue.submit([self._encode(recording.bound)])
        return recording.output

    def _write_inputs(self, tensors, inputs, recorded) -> None:
        """This call's numpy inputs written into the recording's buffers; an input that is the very object the
        recording was made with (a device tensor, the weights' tuple) needs nothing."""
        for t, x, old in zip(tensors, inputs, recorded):
            if x is old and (isinstance(x, DeviceTensor) or self._is_device_tuple(x)):
                continue
            if isinstance(x, (list, tuple)):
                self._write_inputs(t, x, old)
            elif not isinstance(x, DeviceTensor):
                self.device.queue.write_buffer(t.buffer, t.offset, np.ascontiguousarray(x))

    def _is_device_tuple(self, x) -> bool:
        """Whether x is a tuple of device tensors (the weights), known by identity after its first check: a
        tuple's items never change, so a decode step does not walk its hundreds of tensors again."""
        if not isinstance(x, tuple):
            return False
        if self._device_tuples.get(id(x)) is x:
            return True
        if not all(isinstance(t, DeviceTensor) for t in x):
            return False
        self._device_tuples[id(x)] = x
        while len(self._device_tuples) > MAX_RECORDINGS:       # a recording's inputs hold theirs anyway
            self._device_tuples.pop(next(iter(self._device_tuples)))
        return True

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
        pf = self.plan.prim_funcs[func]
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
            kernel = self.plan.kernels[launch["kernel"]]
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

    def _bind(self, dispatches, inputs, output) -> "_Recording":
        """Bind groups and one uniform buffer holding every launch's scalar arguments."""
        wgpu, dev = self._wgpu, self.device
        uniforms = dev.create_buffer(size=max(len(dispatches), 1) * UNIFORM_STRIDE,
                                     usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        if dispatches:
            dev.queue.write_buffer(uniforms, 0, np.concatenate([d[2] for d in dispatches]))
        bound = []
        for i, (name, buffers, _, grid) in enumerate(dispatches):
            pipeline, layout = self._pipelines[name]
            entries = [{"binding": j, "resource": {"buffer": t.buffer, "offset": t.offset, "size": max(4, t.nbytes)}}
                       for j, t in enumerate(buffers)]
            entries.append({"binding": len(buffers),
                            "resource": {"buffer": uniforms, "offset": i * UNIFORM_STRIDE, "size": UNIFORM_STRIDE}})
            bound.append((pipeline, dev.create_bind_group(layout=layout, entries=entries), grid))
        return _Recording(inputs, bound, uniforms, output)

    def _encode(self, bound):
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        current = None
        for pipeline, bind_group, grid in bound:
            if pipeline is not current:         # a pass keeps its pipeline between dispatches
                compute.set_pipeline(pipeline)
                current = pipeline
            compute.set_bind_group(0, bind_group)
            compute.dispatch_workgroups(*grid)
        compute.end()
        return encoder.finish()


@dataclass
class _Recording:
    """A bound call: its input tensors, (pipeline, bind group, grid) per dispatch, the uniforms, the output."""
    inputs: list
    bound: list
    uniforms: object
    output: object
    given: tuple = ()       # the inputs as the recorded call was given them (keeps their identities taken)


def _signature(inputs, is_device_tuple) -> tuple:
    """What a recorded call depends on: numpy inputs by shape and dtype, device tensors by identity, a tuple of
    device tensors (the weights: immutable, so its identity says its contents; the recording holds it, so its id
    is not reused) by identity; any other list or tuple by its items."""
    out = []
    for x in inputs:
        if is_device_tuple(x):
            out.append(("tuple", id(x)))
        elif isinstance(x, (list, tuple)):
            out.append(_signature(x, is_device_tuple))
        elif isinstance(x, DeviceTensor):
            out.append(("device", id(x.buffer), x.offset, x.shape))
        else:
            a = np.asarray(x)
            out.append((a.shape, str(a.dtype)))
    return tuple(out)
