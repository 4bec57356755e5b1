# Q4b: split encode cost (bind-group creation vs recording) and per-dispatch cost on lavapipe
import time, numpy as np
from sharpi_vk_run import VkRuntime, U
rt = VkRuntime("artifact"); rng = np.random.default_rng(0)
t = {k: rt.upload(v) for k, v in dict(x=rng.standard_normal((3, 64)).astype("float32"), g=rng.standard_normal(64).astype("float32"),
     w=rng.standard_normal((64, 96)).astype("float32"), b=rng.standard_normal(96).astype("float32")).items()}
disp, _ = rt.record(t)
def sync(): rt.dev.queue.read_buffer(t["g"][0])
for N in (1, 100):
    d = (disp * 50)[:N] if N > 1 else disp[1:2]
    rt.dev.queue.submit([rt.encode(d)]); sync()
    # bind groups built once (what a runtime can cache when shapes/buffers are stable)
    bgs = []
    for i, (kname, bufs, _, grid) in enumerate(d):
        pipe, bgl = rt.pipes[kname]
        e = [{"binding": j, "resource": {"buffer": b, "offset": off, "size": int(np.prod(s)) * 4}} for j, (b, off, s, dt) in enumerate(bufs)]
        e.append({"binding": len(bufs), "resource": {"buffer": rt.uni, "offset": i * U, "size": 16}})
        bgs.append((pipe, rt.dev.create_bind_group(layout=bgl, entries=e), grid))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); enc = rt.dev.create_command_encoder(); cp = enc.begin_compute_pass()
        for pipe, bg, grid in bgs: cp.set_pipeline(pipe); cp.set_bind_group(0, bg); cp.dispatch_workgroups(*grid)
        cp.end(); cb = enc.finish(); t1 = time.perf_counter(); rt.dev.queue.submit([cb]); sync(); t2 = time.perf_counter()
        ts.append((t1 - t0, t2 - t1))
    a = np.median(np.array(ts), 0) * 1e3
    print(f"{N:4d} dispatches, cached bind groups: encode {a[0]:.3f} ms, submit+wait {a[1]:.2f} ms ({a[1]/N:.3f} ms/dispatch)")
