# Q4: replay the plan.json artifact on Vulkan (lavapipe) through wgpu: one command encoder per call.
import json, os, sys, time, numpy as np
import wgpu, wgpu.backends.wgpu_native.extras as wx

U = 256  # uniform slot stride = min-uniform-buffer-offset-alignment (256 on lavapipe and most GPUs)

class SharpiError(RuntimeError): pass

def open_vulkan_device(need_f16=False):
    wx.set_instance_extras(backends=["Vulkan"])         # never fall back to GL silently
    ads = wgpu.gpu.enumerate_adapters_sync()
    if not ads:
        raise SharpiError("no Vulkan adapter: install a Vulkan driver (CPU: apt-get install mesa-vulkan-drivers libvulkan1)")
    ad = sorted(ads, key=lambda a: a.info["adapter_type"] == "CPU")[0]   # prefer a real GPU over lavapipe
    feats = ["shader-f16"] if need_f16 else []
    if need_f16 and "shader-f16" not in ad.features:
        raise SharpiError(f"{ad.summary} lacks shader-f16")
    lim = {k: ad.limits[k] for k in ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage")}
    return ad, ad.request_device_sync(required_features=feats, required_limits=lim)

def ev(expr, env): return int(eval(expr, {"__builtins__": {}, "min": min, "max": max}, env))

class VkRuntime:
    def __init__(self, art_dir):
        self.plan = json.load(open(f"{art_dir}/plan.json"))
        self.adapter, self.dev = open_vulkan_device(any(b["dtype"] == "float16" for k in self.plan["kernels"].values() for b in k["buffers"]))
        self.pipes = {}
        for name, k in self.plan["kernels"].items():
            entries = [{"binding": i, "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {"type": "storage" if b["access"] == "read_write" else "read-only-storage"}}
                       for i, b in enumerate(k["buffers"])]
            entries.append({"binding": len(k["buffers"]), "visibility": wgpu.ShaderStage.COMPUTE,
                            "buffer": {"type": "uniform", "has_dynamic_offset": False}})
            bgl = self.dev.create_bind_group_layout(entries=entries)
            pipe = self.dev.create_compute_pipeline(layout=self.dev.create_pipeline_layout(bind_group_layouts=[bgl]),
                compute={"module": self.dev.create_shader_module(code=open(f"{art_dir}/{k['wgsl']}").read()), "entry_point": k["entry"]})
            self.pipes[name] = (pipe, bgl)
        self.uni = None

    def buffer(self, nbytes):
        return self.dev.create_buffer(size=max(4, (nbytes + 3) // 4 * 4),
            usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)

    def upload(self, arr):
        arr = np.ascontiguousarray(arr); b = self.buffer(arr.nbytes)
        self.dev.queue.write_buffer(b, 0, arr); return (b, 0, arr.shape, str(arr.dtype))

    def record(self, tensors):
        """Walk the plan: allocate, and record dispatches [(kernel, [(buf,off,nbytes)], pod bytes, grid)]"""
        P = self.plan; env = {}
        for name, (i, j) in P["sym_vars"].items(): env[name] = tensors[P["inputs"][i]["name"]][2][j]
        vals = dict(tensors); storages = {}; disp = []
        for op in P["ops"]:
            if op["op"] == "alloc_storage": storages[op["out"]] = self.buffer(ev(op["nbytes"], env))
            elif op["op"] == "alloc_tensor":
                vals[op["out"]] = (storages[op["storage"]], ev(op["offset"], env), tuple(ev(d, env) for d in op["shape"]), op["dtype"])
            elif op["op"] == "kill": pass          # python GC keeps a storage alive while a tensor uses it
            elif op["op"] == "alias": vals[op["out"]] = vals[op["src"]]
            elif op["op"] == "call":
                pf = P["prim_funcs"][op["func"]]; args = [vals[a] for a in op["args"]]; penv = {}
                for shp, a in zip(pf["param_shapes"], args):          # bind the PrimFunc's own shape vars
                    for d, v in zip(shp, a[2]):
                        if d.isidentifier(): penv[d] = v
                        elif ev(d, penv) != v: raise SharpiError(f"{op['func']}: shape {a[2]} != {shp}")
                for k, e in pf["lets"].items(): penv[k] = ev(e, penv)
                for L in pf["launches"]:
                    k = P["kernels"][L["kernel"]]
                    ext = {t: ev(e, penv) for t, e in L["launch"].items()}
                    grid = [ext.get(f"blockIdx.{c}", 1) for c in "xyz"]; block = [ext.get(f"threadIdx.{c}", 1) for c in "xyz"]
                    assert block == k["workgroup_size"] and grid[2] == 1, (block, grid)
                    gx, gz = grid[0], 1
                    while gx >= 65536: gx, gz = (gx + 1) // 2, gz * 2   # TVM packs blockIdx.x into x*z (webgpu.ts)
                    pod = np.zeros(U // 4, np.int32)
                    for i, (pd, e) in enumerate(zip(k["pod"], L["pod_args"])):
                        v = ev(e, penv); pod.view(np.float32 if pd["wgsl"] == "f32" else np.int32)[i] = v
                    # WGSL guard is `idx > packGridDimX`: pass gridX-1 so padded x*z workgroups exit
                    pod.view(np.uint32)[len(k["pod"]) - 1] = grid[0] - 1 if gz > 1 else grid[0]
                    bufs = [args[ai] for ai in L["buffer_args"]]
                    disp.append((L["kernel"], bufs, pod, (gx, grid[1], gz)))
            else: raise SharpiError(f"unknown op {op}")
        return disp, vals[P["output"]]

    def encode(self, disp):
        n = len(disp)
        if self.uni is None or self.uni.size < n * U:
            self.uni = self.dev.create_buffer(size=max(n, 64) * U, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        self.dev.queue.write_buffer(self.uni, 0, np.concatenate([d[2] for d in disp]))   # all POD args in one write
        enc = self.dev.create_command_encoder(); cp = enc.begin_compute_pass()
        for i, (kname, bufs, _, grid) in enumerate(disp):
            pipe, bgl = self.pipes[kname]
            entries = [{"binding": j, "resource": {"buffer": b, "offset": off, "size": int(np.prod(shp)) * np.dtype(dt).itemsize}}
                       for j, (b, off, shp, dt) in enumerate(bufs)]
            entries.append({"binding": len(bufs), "resource": {"buffer": self.uni, "offset": i * U, "size": 16}})
            cp.set_pipeline(pipe); cp.set_bind_group(0, self.dev.create_bind_group(layout=bgl, entries=entries))
            cp.dispatch_workgroups(*grid)
        cp.end(); return enc.finish()

    def __call__(self, **inputs):
        t = {k: self.upload(v) for k, v in inputs.items()}
        disp, out = self.record(t)
        self.dev.queue.submit([self.encode(disp)])
        b, off, shp, dt = out
        return np.frombuffer(self.dev.queue.read_buffer(b, off, int(np.prod(shp)) * np.dtype(dt).itemsize), dt).reshape(shp)

if __name__ == "__main__":
    rt = VkRuntime("artifact"); print("device:", rt.adapter.summary)
    rng = np.random.default_rng(0)
    g = rng.standard_normal(64).astype("float32"); w = rng.standard_normal((64, 96)).astype("float32"); b = rng.standard_normal(96).astype("float32")
    for n in (3, 1, 70, 1000):
        x = rng.standard_normal((n, 64)).astype("float32")
        out = rt(x=x, g=g, w=w, b=b)
        h = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * g
        ref = h @ w + b + 1.0
        print(f"n={n}: out {out.shape} max abs err {np.abs(out - ref).max():.2e}")
    # timing: 100 dispatches (50 plan replays x 2 kernels, n=3) in ONE command encoder
    t = {k: rt.upload(v) for k, v in dict(x=rng.standard_normal((3, 64)).astype("float32"), g=g, w=w, b=b).items()}
    disp, _ = rt.record(t); disp = disp * 50
    rt.dev.queue.submit([rt.encode(disp)]); rt.dev.queue.read_buffer(t["g"][0])    # warm
    for rep in range(3):
        t0 = time.perf_counter(); cb = rt.encode(disp); t1 = time.perf_counter()
        rt.dev.queue.submit([cb]); rt.dev.queue.read_buffer(t["g"][0]); t2 = time.perf_counter()   # read_buffer waits for the queue
        print(f"{len(disp)} dispatches: encode {1e3*(t1-t0):.2f} ms (incl. {len(disp)} bind groups), submit+wait {1e3*(t2-t1):.2f} ms")
