"""The Vulkan backend: a vulkan artifact's plan run through wgpu on one adapter, behind the same interface as
the TVM backend (sharpi.runtime.tvm_backend), so sessions, the KV bookkeeping and generation are shared."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..common.errors import ArtifactError
from ..common.manifest import PLAN, check_contract
from ..common.plan import Plan
from .loader import check_artifact, weight_arrays
from .plan_runner import DeviceTensor, VulkanPlanRunner
from .wgpu_device import VulkanUnavailableError, list_adapters, open_device

__all__ = ["VulkanBackend", "VulkanPlanRunner", "VulkanUnavailableError", "list_adapters", "open_device"]


class VulkanBackend:
    """A Vulkan artifact on one adapter: weights and the KV page pool live in device buffers; each forward is
    one command encoder and one submit; only logits and keep sets are read back."""
    CODE_FILE = PLAN

    def __init__(self, directory: Path, manifest, *, threads: int = 1, verify: bool = True,
                 adapter: str | None = None):
        check_artifact(directory, manifest, self.CODE_FILE, verify_hashes=verify)
        plan = Plan.read(directory)
        check_contract(directory, manifest, plan.contract, PLAN)
        self.runner = VulkanPlanRunner(directory, adapter or os.environ.get("SHARPI_VULKAN_ADAPTER") or None, plan)
        info = self.runner.adapter.info
        self.description = f"Vulkan: {info['device']} ({info['adapter_type']})"
        self.functions = set(manifest.functions) & set(self.runner.plan.functions)
        self.weights = tuple(self._upload_weights(directory, manifest))     # a tuple: the plan runner's recordings
                                                                            # know it by identity
        self.pool: DeviceTensor | None = None
        self.states: DeviceTensor | None = None       # a hybrid model's recurrent-state pool

    def _upload_weights(self, directory: Path, manifest) -> list[DeviceTensor]:
        limit = self.runner.max_binding_size
        tensors = []
        for p, array in weight_arrays(directory, manifest):
            if p.nbytes > limit:
                raise VulkanUnavailableError(f"{p.name} takes {p.nbytes >> 20} MiB, more than the {limit >> 20} "
                                             f"MiB a storage buffer of {self.runner.adapter_name} may bind.")
            tensors.append(self.runner.upload(array, persistent=True))
        return tensors

    # -- the KV page pool -------------------------------------------------------------------------------------
    def allocate_pool(self, shape: tuple, dtype: str = "float32") -> int:
        """One buffer of the pool's shape (kv_format: [pages, 2, kv_heads, page_size, head_dim], or the packed
        [pages, 1, kv_heads, page_size, row_bytes] uint8, which the kernels view as words), capped at the adapter's
        storage-binding limit (128 MiB on lavapipe); returns the page count it holds."""
        page_bytes = np.dtype(dtype).itemsize * int(np.prod(shape[1:]))
        pages = max(1, min(int(shape[0]), self.runner.max_binding_size // page_bytes))
        shape = (pages, *shape[1:])
        self.pool = DeviceTensor(self.runner.buffer(pages * page_bytes), 0, shape, dtype)
        self._page_bytes = page_bytes
        return pages

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy pages within the pool, through a scratch buffer (WebGPU forbids a copy within one buffer)."""
        if not src:
            return
        size = self._page_bytes
        scratch = self.runner.buffer(len(src) * size)
        encoder = self.runner.device.create_command_encoder()
        for i, s in enumerate(src):
            encoder.copy_buffer_to_buffer(self.pool.buffer, s * size, scratch, i * size, size)
        for i, d in enumerate(dst):
            encoder.copy_buffer_to_buffer(scratch, i * size, self.pool.buffer, d * size, size)
        self.runner.device.queue.submit([encoder.finish()])

    def read_pages(self, pages: list[int]) -> np.ndarray:
        queue, shape = self.runner.device.queue, self.pool.shape[1:]
        return np.stack([np.frombuffer(queue.read_buffer(self.pool.buffer, p * self._page_bytes, self._page_bytes),
                                       self.pool.dtype).reshape(shape) for p in pages])

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        for p, page in zip(pages, data):
            self.runner.device.queue.write_buffer(self.pool.buffer, p * self._page_bytes,
                                                  np.ascontiguousarray(page, self.pool.dtype))

    def allocate_states(self, shape: tuple) -> None:
        """The recurrent-state pool [slots, DeltaNet layers, width] f32, zeroed (slot 0 is the empty state); one
        buffer, so it must fit the adapter's storage-binding limit."""
        nbytes = 4 * int(np.prod(shape))
        if nbytes > self.runner.max_binding_size:
            raise ArtifactError(f"The recurrent-state pool ({nbytes >> 20} MiB for {shape[0] - 1} sequences) is "
                                f"more than a storage buffer of {self.runner.adapter_name} may bind "
                                f"({self.runner.max_binding_size >> 20} MiB); load the model with fewer "
                                f"pool_sequences.")
        self.states = self.runner.upload(np.zeros(shape, np.float32))

    def copy_state(self, src: int, dst: int) -> None:
        self.runner.run_on_device("state_copy", self.states, np.array([src, dst], np.int32))

    # -- calls ------------------------------------------------------------------------------------------------
    def forward(self, function: str, ids, positions, page_table, kv_lens, extra: tuple = (), slots=None):
        # decode is replayed from a recording (its shapes never change); a prefill chunk is bound afresh, since a
        # recording per chunk length would pin its activations (and prefill_snapkv's scores outlive the call)
        states = () if slots is None else (self.states, np.asarray(slots, np.int32))
        out = self.runner.run_on_device(function, ids, positions, self.pool, page_table, kv_lens, *states,
                                        self.weights, *extra, reuse=function == "decode")
        if function == "prefill_snapkv":
            return self.runner.download(out[0]), out[1]
        return self.runner.download(out)

    def select(self, scores: DeviceTensor, params: np.ndarray):
        keep = self.runner.run_on_device("snapkv_select", scores, params)
        return keep, self.runner.download(keep)

    def to_host(self, tensor: DeviceTensor) -> np.ndarray:
        return self.runner.download(tensor)

    def compact(self, page_table: np.ndarray, keep, counts: np.ndarray) -> None:
        self.runner.run_on_device("snapkv_compact", self.pool, page_table, keep, np.asarray(counts, np.int32))
