"""Write moe_golden.json and moe_golden.npz: llama.cpp's logits for the tiny random mixture-of-experts GGUFs of
tests/tiny_gguf.py (`write_tiny_moe`: olmoe, qwen2moe, qwen3moe, granitemoe), teacher-forced over a fixed
sequence. Run once with llama-cpp-python 0.3.36 (llama.cpp 0c1e570) built from source, from the repo's root:

    /path/to/llama-venv/bin/python tests/data/make_moe_golden.py

For each architecture the first seed whose router is nowhere near a tie is kept: at every position and layer the
k-th and (k+1)-th router probabilities (the numpy reference's) are at least MIN_GAP apart, so an implementation's
rounding cannot flip an expert choice. llama.cpp runs with an f32 KV cache and one batch; the GGUF's sha256 is
stored so that the tests can tell when the writer no longer makes the same file."""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))
from sharpi.testing.reference import NumpyReference  # noqa: E402
from tiny_gguf import MOE_ARCHS, write_tiny_moe  # noqa: E402

MIN_GAP = 1e-3
TOKENS = 48
ROUTER_SCALE = 2.0      # sharper router probabilities (a peaked softmax would shrink the gaps again)
GGML_TYPE_F32 = 0


def router_gap(path: Path, ids: list[int]) -> float:
    """The smallest gap between the k-th and (k+1)-th router probability over every position and MoE layer."""
    ref = NumpyReference(path)
    ref.router_capture = []
    ref.forward(ids)
    k = ref.config.n_experts_used
    gaps = [np.diff(-np.sort(-probs, axis=-1)[:, k - 1:k + 1], axis=-1) for probs in ref.router_capture]
    return float(-np.max(gaps))


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    model = llama_cpp.Llama(str(path), n_ctx=2 * TOKENS, n_batch=2 * TOKENS, logits_all=True, type_k=GGML_TYPE_F32,
                            type_v=GGML_TYPE_F32, flash_attn=False, n_threads=2, verbose=False)
    model.eval(ids)
    return np.array(model.scores[:len(ids)], dtype=np.float32)


def main() -> None:
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 256, TOKENS)]
    meta = {"source": f"llama-cpp-python {llama_cpp.__version__}, f32 KV cache, teacher-forced logits of `ids`",
            "ids": ids, "min_gap": MIN_GAP, "models": {}}
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in MOE_ARCHS:
            for seed in range(100):
                path = write_tiny_moe(Path(tmp) / f"{arch}.gguf", arch, seed=seed, router_scale=ROUTER_SCALE)
                gap = router_gap(path, ids)
                if gap >= MIN_GAP:
                    break
            else:
                raise SystemExit(f"{arch}: no seed below 100 keeps the router {MIN_GAP} from a tie")
            logits[arch] = llama_cpp_logits(path, ids)
            meta["models"][arch] = {"seed": seed, "router_scale": ROUTER_SCALE, "router_gap": gap,
                                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            print(f"{arch}: seed {seed}, smallest router gap {gap:.2e}")
    (HERE / "moe_golden.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    np.savez_compressed(HERE / "moe_golden.npz", **logits)
    print(f"wrote {HERE / 'moe_golden.json'} and moe_golden.npz")


if __name__ == "__main__":
    main()
