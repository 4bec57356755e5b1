"""Quantized weights stay quantized: in the artifact and in what the runtime holds."""
import numpy as np

from sharpi.common.manifest import WEIGHTS


def test_artifact_weights_within_1_3x_of_gguf(smollm2_artifact, smollm2_gguf):
    ratio = (smollm2_artifact / WEIGHTS).stat().st_size / smollm2_gguf.stat().st_size
    assert ratio <= 1.3, ratio


def test_runtime_holds_no_float_copy_of_a_quantized_weight(smollm2):
    params = smollm2.manifest.params
    assert len(params) == len(smollm2.engine.backend.weights)
    by_tensor = {}
    for entry, held in zip(params, smollm2.engine.backend.weights):
        assert list(held.shape) == entry.shape and str(held.dtype) == entry.dtype   # what the runtime holds
        tensor, part = entry.name.split(":")
        by_tensor.setdefault(tensor, {})[part] = held
    quantized = {t: parts for t, parts in by_tensor.items() if "qs" in parts}
    assert len(quantized) == 1 + 7 * smollm2.config.n_layers     # every matrix of SmolLM2 is quantized
    for tensor, parts in quantized.items():
        assert set(parts) == {"qs", "s"}, tensor
        assert str(parts["qs"].dtype) in ("uint32", "int8"), tensor
        n_rows = parts["qs"].shape[0]
        k = parts["s"].shape[2] * 32
        # the only floats of a quantized matrix are its per-block scales: at most 2 per 32 weights
        assert int(np.prod(parts["s"].shape)) <= n_rows * k // 16, tensor
    held = sum(int(np.prod(w.shape)) * np.dtype(str(w.dtype)).itemsize for w in smollm2.engine.backend.weights)
    assert held <= 1.3 * smollm2.manifest.source["size"]


def test_cpu_weights_are_views_of_the_mapped_file(smollm2):
    """On the CPU the runtime's weights are the artifact's file mapped, not copies: consecutive parameters lie
    exactly as far apart in memory as in the file, and the pages are file-backed (not anonymous memory)."""
    held = smollm2.engine.backend.weights
    params = smollm2.manifest.params
    address = [np.from_dlpack(w).__array_interface__["data"][0] for w in held]
    base = address[0] - params[0].offset
    assert all(a - base == p.offset for a, p in zip(address, params))
    maps = open("/proc/self/maps").read().splitlines()
    span = next(line for line in maps if int(line.split("-")[0], 16) <= base < int(line.split()[0].split("-")[1], 16))
    assert span.endswith(str((smollm2.path / WEIGHTS).resolve())), span
