"""The conformance suite's options, one definition for both ways of running it: `sharpi check` (--reference,
--gguf, --prompt, --decode-tokens) and the pytest plugin (the same with a --sharpi- prefix). Light on purpose (no
numpy, no suite): the CLI builds its parser from it on every command."""
from __future__ import annotations

REFERENCES = ("numpy", "cpu")

SUITE_OPTIONS = {
    "reference": dict(default="numpy", choices=REFERENCES,
                      help="what logits are compared with: numpy (exact float32 forward pass of the source GGUF, "
                           "default) or cpu (an llvm artifact of the same GGUF, compiled on demand into the cache)"),
    "gguf": dict(action="append", default=[], metavar="PATH",
                 help="the GGUF an artifact was compiled from, when it is not a known model in $SHARPI_HOME nor "
                      "beside the artifact (repeatable; matched to artifacts by sha256)"),
    "prompt": dict(default=None, metavar="TEXT", help="the prompt every check feeds (default: about 24 tokens of "
                                                      "English)"),
    "decode-tokens": dict(default=None, metavar="N", help="greedy tokens generated through the KV cache (default 16)"),
}
