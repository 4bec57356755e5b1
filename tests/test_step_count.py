"""What a GPU decode step costs the host, counted statically in compiled artifacts (sharpi.testing.step_count): at
most 7 kernel launches a layer plus the head on cuda and vulkan (the fused GEMVs of codegen.decode_fusion; 14 a
layer before them), and at most 400 Relax VM builtin calls a plain cuda step (2,865 before codegen.vm_overhead
lifted the weights' views and tuple accesses to load time and spared the frees)."""
import pytest

import sharpi
from sharpi.common.manifest import Manifest
from sharpi.testing.step_count import step_count
from test_cuda_build import _nvcc  # noqa: F401  (autouse: nvcc present, or skipped outside CI)

LAYER_LAUNCHES = 7
HEAD_LAUNCHES = 3           # the embedding, the final norm, the output matrix
BUILTINS = 400


@pytest.fixture(scope="module")
def qwen_artifacts(tmp_path_factory):
    """Qwen2.5-Coder-0.5B (q/k/v biases, NEOX RoPE, q4_K beside q6_K and q8_0) for cuda and vulkan."""
    from sharpi.frontend.fetch import fetch
    gguf = str(fetch("qwen2.5-coder-0.5b", show_progress=False))
    folder = tmp_path_factory.mktemp("qwen-gpu")
    return {target: sharpi.compile(gguf, target=target, output=folder / target) for target in ("cuda", "vulkan")}


def _layers(artifact) -> int:
    return Manifest.read(artifact).config["n_layers"]


def _check_launches(artifact, layers: int):
    count = step_count(artifact)
    assert count.kernels_total() <= LAYER_LAUNCHES * layers + HEAD_LAUNCHES, count.by_family()
    families = count.by_family()
    # each layer's norm, q, k, v (and RoPE where no q/k norm comes between) one launch; norm, gate, up and GLU one
    assert sum(n for f, n in families.items() if f.startswith("gpu_gemv_split")) == layers, families
    assert sum(n for f, n in families.items() if f.startswith("gpu_gemv_glu")) == layers, families
    assert not any(f.startswith(("rms_norm", "rope")) for f in families), families
    return count


def test_smollm2_decode_step(smollm2_cuda_artifact, smollm2_vulkan_artifact):
    layers = _layers(smollm2_cuda_artifact)
    cuda = _check_launches(smollm2_cuda_artifact, layers)
    assert cuda.builtins_total() <= BUILTINS, cuda.builtins
    assert cuda.builtins["vm.builtin.null_value"] == 0 and cuda.builtins["vm.builtin.tuple_getitem"] == 0
    vulkan = _check_launches(smollm2_vulkan_artifact, layers)
    assert vulkan.kernels_total() < cuda.kernels_total()       # one attention kernel a layer: no split, no combine


def test_qwen_decode_step(qwen_artifacts):
    layers = _layers(qwen_artifacts["cuda"])
    cuda = _check_launches(qwen_artifacts["cuda"], layers)
    assert cuda.builtins_total() <= BUILTINS, cuda.builtins
    _check_launches(qwen_artifacts["vulkan"], layers)


def test_the_prompt_functions_keep_their_frees(smollm2_cuda_artifact):
    """Only decode, whose every intermediate lives in storage planned once a call, goes without frees: a prompt's
    intermediates grow with its length and are freed after their last use."""
    assert step_count(smollm2_cuda_artifact, "prefill").builtins["vm.builtin.null_value"] > 0
