"""The backend for artifacts TVM's own runtime executes (llvm, cuda): a Relax VM, weights as TVM tensors on the
device, and the KV page pool as one TVM tensor that the kernels write in place."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..common.errors import ConfigError, SharpiError
from ..common.kv_format import POOL_ITEMSIZE
from ..common.manifest import LIBRARY, Manifest
from ..common.targets import target_spec
from .kv_cache import PoolAllocationError
from .loader import check_artifact, configure_threads, first_line, load_vm, load_weights


class CudaUnavailableError(SharpiError):
    """A cuda artifact was loaded where no CUDA device is available."""


class TVMBackend:
    """Artifacts whose target runs on TVM's Relax VM (sharpi.common.targets: runtime "tvm-vm"), on the CPU or a
    CUDA GPU as the target's tvm_device says."""
    CODE_FILE = LIBRARY

    def __init__(self, directory: Path, manifest: Manifest, *, threads: int, verify: bool = True,
                 adapter: str | None = None, lock_weights: bool = False):
        """lock_weights: a CPU artifact's weights locked in memory (loader.lock_in_memory); open_backend
        refuses it for GPU artifacts."""
        import tvm

        spec = target_spec(manifest.target["kind"])
        if adapter is not None:
            raise ConfigError(f"adapter applies to Vulkan artifacts only; {directory} targets {spec.name}.")
        check_artifact(directory, manifest, self.CODE_FILE, verify_hashes=verify)
        self.on_host = spec.tvm_device == "cpu"      # the pool is host memory: numpy views of it are zero-copy
        if self.on_host:
            configure_threads(threads)
            self.device = tvm.cpu()
            self.description = f"CPU ({manifest.target.get('mcpu')}, {threads} threads)"
        else:
            self.device = _cuda_device(directory)
            self.description = f"CUDA: {self.device.device_name} (artifact for {manifest.target.get('arch')})"
        self._vm = load_vm(directory, manifest, self.device)       # checks the kernel contract first
        self.weights = load_weights(directory, manifest, self.device, lock=lock_weights)
        self.functions = {name: self._vm[name] for name in manifest.functions}
        self._weight_args = self._lifted_weights(manifest)
        self.pool = None
        self.states = None              # a hybrid model's recurrent-state pool
        self._pool_view = None
        self._decode_buffers = None
        self._fixed_decode_inputs = not self.on_host   # --cuda-graph replays decode from fixed input buffers

    def _lifted_weights(self, manifest: Manifest) -> dict:
        """function -> the weights it takes as parameters of its own, for the functions whose weight-only work
        the compiler lifted into `NAME_transform_params` (the cuda target's "lifted_params"), run here once."""
        # its one parameter is the tuple of the function's weight parameters: here the one weight tuple
        return {name: tuple(self._vm[f"{name}_transform_params"]([self.weights]))
                for name in manifest.target.get("lifted_params") or ()}

    # -- the KV page pool -------------------------------------------------------------------------------------
    def allocate_pool(self, shape: tuple, dtype: str = "float32") -> int:
        """Reserve the pool [pages, 2, kv_heads, page_size, head_dim]; returns the page count. Untouched pages
        cost no resident memory (the OS maps them when a kernel first writes them)."""
        import tvm

        try:
            self.pool = tvm.runtime.empty(shape, dtype, self.device)
        except Exception as exc:       # TVM's out-of-memory is a plain error with a multi-line message
            nbytes = POOL_ITEMSIZE[dtype] * int(np.prod(shape, dtype=object))
            raise PoolAllocationError(f"The KV page pool ({nbytes / 2**30:.1f} GiB for {shape[0]} pages) cannot be "
                                      f"allocated on {self.description} ({first_line(exc)}); load the model with "
                                      f"fewer pool_sequences.") from None
        return int(shape[0])

    def allocate_states(self, shape: tuple) -> None:
        """The recurrent-state pool [slots, DeltaNet layers, width] f32 of a hybrid model; slot 0 zeroed (the
        empty state new sequences copy)."""
        import tvm

        try:
            self.states = tvm.runtime.empty(shape, "float32", self.device)
        except Exception as exc:
            nbytes = 4 * int(np.prod(shape, dtype=object))
            raise PoolAllocationError(f"The recurrent-state pool ({nbytes / 2**30:.1f} GiB for {shape[0] - 1} "
                                      f"sequences) cannot be allocated on {self.description} ({first_line(exc)}); "
                                      f"load the model with fewer pool_sequences.") from None
        first = self.states._create_view(tuple(int(d) for d in shape[1:]), "float32")
        first.copyfrom(np.zeros(shape[1:], np.float32))

    def copy_state(self, src: int, dst: int) -> None:
        import tvm

        self.functions["state_copy"](self.states, tvm.runtime.tensor(np.array([src, dst], np.int32), self.device))

    def pool_view(self) -> np.ndarray:
        """The pool as a numpy array (zero-copy: CPU only). numpy's DLPack import has no bfloat16, so a bf16
        pool is taken as uint16 and relabelled with ml_dtypes' bfloat16 (TVM's own dependency)."""
        if self._pool_view is None:
            if str(self.pool.dtype) == "bfloat16":
                import ml_dtypes
                bits = self.pool._create_view(tuple(int(d) for d in self.pool.shape), "uint16")
                self._pool_view = np.from_dlpack(bits).view(ml_dtypes.bfloat16)
            else:
                self._pool_view = np.from_dlpack(self.pool)
        return self._pool_view

    def _page(self, page: int):
        """One page of the pool as a TVM view (no copy), for device-side page copies."""
        shape, dtype = tuple(int(d) for d in self.pool.shape[1:]), str(self.pool.dtype)
        size = POOL_ITEMSIZE[dtype] * int(np.prod(shape))
        return self.pool._create_view(shape, dtype, relative_byte_offset=page * size)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        if self.on_host:
            view = self.pool_view()
            view[dst] = view[src]
        else:
            for s, d in zip(src, dst):
                self._page(s).copyto(self._page(d))

    def read_pages(self, pages: list[int]) -> np.ndarray:
        if self.on_host:
            return self.pool_view()[pages]
        return np.stack([self._page(p).numpy() for p in pages])

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        if self.on_host:
            self.pool_view()[pages] = data
            return
        for p, page in zip(pages, data):
            self._page(p).copyfrom(np.ascontiguousarray(page, str(self.pool.dtype)))

    # -- calls ------------------------------------------------------------------------------------------------
    def forward(self, function: str, ids, positions, page_table, kv_lens, extra: tuple = (), slots=None):
        """A forward function: logits as numpy; for prefill_snapkv (logits, scores on the device). slots: a
        hybrid model's state slot of each token."""
        import tvm

        dev = self.device
        inputs = (ids, positions, page_table, kv_lens) + (() if slots is None else (slots,))
        if function == "decode" and self._fixed_decode_inputs:     # the slots too: a captured graph reads them
            inputs = self._decode_inputs(*inputs)
        else:
            inputs = [tvm.runtime.tensor(a, dev) for a in inputs]
        ids, positions, page_table, kv_lens, *slots = inputs
        states = (self.states, *slots) if slots else ()
        weights = self._weight_args.get(function, (self.weights,))
        out = self.functions[function](ids, positions, self.pool, page_table, kv_lens, *states, *weights,
                                       *[tvm.runtime.tensor(e, dev) for e in extra])
        if function == "prefill_snapkv":
            return out[0].numpy(), out[1]
        return out.numpy()

    def _decode_inputs(self, *arrays: np.ndarray) -> list:
        """decode's inputs in the same device buffers at every call, this step's values copied in: an artifact
        compiled with --cuda-graph replays a graph captured with these buffers' addresses. (Decode's input
        shapes are fixed: one token, the full page table.)"""
        import tvm

        if self._decode_buffers is None:
            self._decode_buffers = [tvm.runtime.empty(a.shape, str(a.dtype), self.device) for a in arrays]
        for buffer, array in zip(self._decode_buffers, arrays):
            buffer.copyfrom(np.ascontiguousarray(array))
        return self._decode_buffers

    def select(self, scores, params: np.ndarray):
        """snapkv_select: (keep on the device, keep as numpy [L, KVH, slots])."""
        import tvm

        scores = tvm.runtime.tensor(scores, self.device) if isinstance(scores, np.ndarray) else scores
        keep = self.functions["snapkv_select"](scores, tvm.runtime.tensor(params, self.device))
        return keep, keep.numpy()

    def to_host(self, tensor) -> np.ndarray:
        return tensor.numpy()

    def compact(self, page_table: np.ndarray, keep, counts: np.ndarray) -> None:
        """snapkv_compact: slot keep[l, h, i] -> slot i for i < counts[l], in place in the pool."""
        import tvm

        dev = self.device
        keep = tvm.runtime.tensor(keep, dev) if isinstance(keep, np.ndarray) else keep
        self.functions["snapkv_compact"](self.pool, tvm.runtime.tensor(page_table, dev), keep,
                                         tvm.runtime.tensor(np.asarray(counts, np.int32), dev))


def _cuda_device(directory: Path):
    """CUDA device 0, or CudaUnavailableError saying why there is none."""
    import tvm

    from ..common.tvm_cuda import load_tvm_cuda_runtime

    reason = "no CUDA device (an NVIDIA GPU with its driver)"
    try:
        load_tvm_cuda_runtime()
    except OSError as exc:
        reason = f"no usable CUDA runtime ({exc})"
    device = tvm.cuda(0)
    if not device.exist:
        raise CudaUnavailableError(f"{directory} is a cuda artifact and this machine has {reason}; compile for llvm "
                                   f"or vulkan to run here.")
    return device
