"""The interface where the runtime's two backends meet the shared code (sessions, the paged KV cache, generation):
TVM's Relax VM for llvm and cuda artifacts (tvm_backend.TVMBackend) and the Vulkan plan on wgpu
(vulkan.VulkanBackend). Which runs an artifact is the target table's `runtime` (sharpi.common.targets)."""
from __future__ import annotations

from pathlib import Path
from typing import Collection, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Backend(Protocol):
    CODE_FILE: str                 # the artifact file holding its code (model.so, plan.json)
    description: str               # where it runs, in words
    functions: Collection[str]     # the artifact's Relax functions it can call
    weights: list                  # the parameters, in manifest order, on the device

    # -- the KV page pool [pages, 2, kv_heads, page_size, head_dim], one per model --------------------------------
    def allocate_pool(self, shape: tuple, dtype: str) -> int:
        """Allocate the pool (or as much of it as the device can bind); returns the pages it holds."""

    def copy_pages(self, src: list[int], dst: list[int]) -> None: ...

    def read_pages(self, pages: list[int]) -> np.ndarray: ...

    def write_pages(self, pages: list[int], data: np.ndarray) -> None: ...

    # -- calls ------------------------------------------------------------------------------------------------
    def forward(self, function: str, ids: np.ndarray, positions: np.ndarray, page_table: np.ndarray,
                kv_lens: np.ndarray, extra: tuple = (), slots: np.ndarray | None = None):
        """Run prefill / prefill_logits / decode (logits as numpy) or prefill_snapkv ((logits, scores), the
        scores left on the device for select). slots: a hybrid model's state slot of each token (its functions
        take the state pool and them after the KV inputs)."""

    # -- a hybrid model's recurrent-state pool [slots, DeltaNet layers, width] f32 (runtime.state_pool) -------------
    def allocate_states(self, shape: tuple) -> None: ...

    def copy_state(self, src: int, dst: int) -> None: ...

    def select(self, scores, params: np.ndarray):
        """snapkv_select of scores on the device or in numpy: (keep on the device, keep as numpy [L, KVH, slots])."""

    def to_host(self, tensor) -> np.ndarray:
        """A device tensor (prefill_snapkv's scores) as numpy."""

    def compact(self, page_table: np.ndarray, keep, counts: np.ndarray) -> None:
        """snapkv_compact: slot keep[l, h, i] -> slot i for i < counts[l], in place in the pool."""


class BackendFactory(Protocol):
    CODE_FILE: str

    def __call__(self, directory: Path, manifest, *, threads: int, verify: bool, adapter: str | None) -> Backend: ...
