"""Write hybrid_golden.json and hybrid_golden.npz: llama.cpp's logits for the tiny random hybrid linear-attention
GGUFs of tests/tiny_gguf.py (`write_tiny_hybrid`: qwen35, qwen35moe, qwen3next), teacher-forced over a fixed
sequence. Run once with llama-cpp-python 0.3.36 (llama.cpp 0c1e570) built from source, from the repo's root:

    /path/to/llama-venv/bin/python tests/data/make_hybrid_golden.py

qwen35 and qwen35moe alternate DeltaNet and attention layers (full_attention_interval 2); qwen3next leaves the
interval out (llama.cpp's default 4: three DeltaNet layers, then attention). Each has 4 v-heads over 2 k-heads, so
the head mapping matters, and one multi-token-prediction block that the main pass skips. For the mixtures of
experts the first seed whose router is nowhere near a tie is kept, as make_moe_golden.py does."""
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import llama_cpp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from make_moe_golden import MIN_GAP, ROUTER_SCALE, TOKENS, llama_cpp_logits, router_gap  # noqa: E402
from tiny_gguf import HYBRID_ARCHS, write_tiny_hybrid  # noqa: E402

INTERVALS = {"qwen35": 2, "qwen35moe": 2, "qwen3next": None}


def main() -> None:
    ids = [int(i) for i in np.random.default_rng(0).integers(0, 256, TOKENS)]
    meta = {"source": f"llama-cpp-python {llama_cpp.__version__}, f32 KV cache, teacher-forced logits of `ids`",
            "ids": ids, "min_gap": MIN_GAP, "models": {}}
    logits = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in HYBRID_ARCHS:
            moe = arch != "qwen35"
            for seed in range(100):
                path = write_tiny_hybrid(Path(tmp) / f"{arch}.gguf", arch, seed=seed, interval=INTERVALS[arch],
                                         router_scale=ROUTER_SCALE if moe else 1.0)
                gap = router_gap(path, ids) if moe else None
                if gap is None or gap >= MIN_GAP:
                    break
            else:
                raise SystemExit(f"{arch}: no seed below 100 keeps the router {MIN_GAP} from a tie")
            logits[arch] = llama_cpp_logits(path, ids)
            meta["models"][arch] = {"seed": seed, "interval": INTERVALS[arch],
                                    "router_scale": ROUTER_SCALE if moe else 1.0, "router_gap": gap,
                                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            print(f"{arch}: seed {seed}, smallest router gap {gap}")
    (HERE / "hybrid_golden.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    np.savez_compressed(HERE / "hybrid_golden.npz", **logits)
    print(f"wrote {HERE / 'hybrid_golden.json'} and hybrid_golden.npz")


if __name__ == "__main__":
    main()
