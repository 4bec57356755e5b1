"""A generation ends where llama.cpp's does: sharpi's stop ids for each real test model are llama.cpp's
end-of-generation set (llama_vocab_is_eog over the whole vocabulary, tests/data/eog_ids.json made by
tests/data/make_eog_golden.py): the GGUF's eos and eot ids, the end-of-turn and end-of-text tokens found by their
text (a Qwen's <|endoftext|>, SmolLM2's <|endoftext|>) and the fill-in-the-middle padding and file separators."""
import json
from pathlib import Path

import pytest

from sharpi.common.tokenizer import build_from_gguf_metadata
from sharpi.frontend.fetch import fetch
from sharpi.frontend.gguf_file import GGUFFile

GOLDEN = json.loads((Path(__file__).parent / "data" / "eog_ids.json").read_text(encoding="utf-8"))["models"]
MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
          "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"}


@pytest.mark.parametrize("name", MODELS)
def test_stop_ids_are_llama_cpps_end_of_generation_set(name):
    path = fetch(name, show_progress=False)
    assert path.name == MODELS[name]
    tokenizer, info = build_from_gguf_metadata(GGUFFile(path).metadata)
    assert info.stop_ids == GOLDEN[path.name]["ids"]
    assert [tokenizer.token_text(i) for i in info.stop_ids] == GOLDEN[path.name]["texts"]
