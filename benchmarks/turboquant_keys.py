"""What TurboQuant keys need on real models: the float32 numpy reference's perplexity on the golden text with its
keys stored by variants of the TurboQuant codec (values exact), beside f16 and q4_ch keys. The variants are
numpy-only codecs registered for the run (sharpi.common.kv_codecs), so the question is answered before any kernel
is written for them.

    python benchmarks/turboquant_keys.py [--models smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b] [--tokens 318]
        [--values float32,q8_0,q4_0,tq4,tq3]     (value types under exact keys instead)

Variants: tq4 / tq3 as shipped (the rotated key and its norm); "-pagemean": each page's per-channel mean (over its
16 slots, kept exact here) taken out before the rotation and added back when read, as a page codec would store it
(the mean's rotation preserves attention's reading in the rotated space); "-mean": the same with one mean per
channel over the whole text (an oracle a calibration could approach); "-outliersN": each page's N channels of largest
mean |x| kept as f16 and TurboQuant of the rest (the paper's outlier split, chosen per page); "-pagemean-outliersN":
both, the mean first.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sharpi.common import kv_codecs
from sharpi.common.kv_codecs.turboquant import TurboQuant
from sharpi.frontend.fetch import fetch
from sharpi.testing.reference import NumpyReference, log_softmax

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
GOLDEN = {"smollm2-135m": "smollm2-135m-instruct-q4_1.json", "gemma3-270m": "gemma3-270m-q4_k_m.json",
          "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.json"}


class MeanFirst(TurboQuant):
    """TurboQuant of x minus a per-channel mean: over each page's slots (page=True) or over all of x."""

    def __init__(self, bits: int, page: bool):
        super().__init__(bits)
        self.page_scaled = page
        self.name = self.flag = f"tq{bits}-{'pagemean' if page else 'mean'}"

    def roundtrip(self, x, head_dim, page_size):
        x = np.asarray(x, np.float32)
        mean = x.mean(axis=-2, keepdims=True)       # a page codec sees [..., n, d]: one page's slots
        return self.plain(x - mean, head_dim, page_size) + mean

    def plain(self, x, head_dim, page_size):
        """TurboQuant's own round trip (the stored rotation and norm, read back)."""
        part = self.part(head_dim, page_size, 0)
        return self.dequantize(part, *self.quantize(part, x))


class OutliersApart(MeanFirst):
    """Each page's `count` channels of largest mean |x| kept as f16 (an index and a half each, as a page codec would
    store them), TurboQuant of the rest (those channels zeroed): the paper's outlier split, chosen per page."""

    def __init__(self, bits: int, count: int):
        super().__init__(bits, page=True)
        self.count = count
        self.name = self.flag = f"tq{bits}-outliers{count}"

    def roundtrip(self, x, head_dim, page_size):
        x = np.asarray(x, np.float32)
        top = np.argsort(-np.abs(x).mean(axis=-2), axis=-1)[..., :self.count]          # [..., count]
        mask = np.zeros(x.shape[:-2] + (1, head_dim), bool)
        np.put_along_axis(mask, top[..., None, :], True, axis=-1)
        rest = self.plain(np.where(mask, np.float32(0), x), head_dim, page_size)
        return np.where(mask, x.astype(np.float16).astype(np.float32), rest)


class MeanThenOutliers(OutliersApart):
    """Both: each page's channel mean out first, then its outlier channels apart."""

    def __init__(self, bits: int, count: int):
        super().__init__(bits, count)
        self.name = self.flag = f"tq{bits}-pagemean-outliers{count}"

    def roundtrip(self, x, head_dim, page_size):
        x = np.asarray(x, np.float32)
        mean = x.mean(axis=-2, keepdims=True)
        return super().roundtrip(x - mean, head_dim, page_size) + mean


def perplexity(logits, ids) -> float:
    lp = log_softmax(logits)
    return float(np.exp(-lp[np.arange(len(ids) - 1), np.asarray(ids[1:])].mean()))


class WholeTextMean(MeanFirst):
    """kv_roundtrip hands a slot codec the whole [T, KVH, D] of a layer: the mean over axis 0 (the text)."""

    def roundtrip(self, x, head_dim, page_size):
        x = np.asarray(x, np.float32)
        mean = x.mean(axis=0, keepdims=True)
        return self.plain(x - mean, head_dim, page_size) + mean


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b")
    p.add_argument("--tokens", type=int, default=318)
    p.add_argument("--keys", default="float32,float16,q4_ch,tq4,tq3,tq4-pagemean,tq3-pagemean,tq4-mean,tq3-mean")
    p.add_argument("--values", default=None, help="instead: these value types under exact keys (e.g. "
                                                   "float32,q8_0,q4_0,tq4,tq3)")
    args = p.parse_args()
    for bits in (3, 4):
        kv_codecs.register(MeanFirst(bits, page=True))
        kv_codecs.register(WholeTextMean(bits, page=False))
        for count in (4, 8):
            kv_codecs.register(OutliersApart(bits, count))
            kv_codecs.register(MeanThenOutliers(bits, count))
    side = "values" if args.values else "keys"
    print(f"| model | {side} | perplexity | vs f32 {side} |\n| --- | --- | ---: | ---: |")
    for model in args.models.split(","):
        ids = json.loads((DATA / GOLDEN[model]).read_text())["teacher_forced"]["ids"][:args.tokens]
        ref = NumpyReference(fetch(model, show_progress=False))
        base = None
        for kind in (args.values or args.keys).split(","):
            ref.kv_types = ("float32", kind) if args.values else (kind, "float32")
            ppl = perplexity(ref.forward(ids), ids)
            base = base or ppl
            print(f"| {model} | {kind} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
