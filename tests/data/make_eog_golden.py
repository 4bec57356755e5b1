"""Write eog_ids.json: the token ids llama.cpp ends a generation at (llama_vocab_is_eog) for each real test model,
with their texts. Run once with llama-cpp-python (0.3.36, llama.cpp 0c1e570) on the models `sharpi fetch` puts in
$SHARPI_HOME/models:

    /path/to/llama-venv/bin/python tests/data/make_eog_golden.py ~/.cache/sharpi/models/*.gguf

tests/test_stop_ids.py holds sharpi's stop ids to these."""
import json
import sys
from pathlib import Path

import llama_cpp


def eog_ids(path: str) -> dict:
    model = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(model.model)
    ids = [i for i in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    return {"ids": ids, "texts": [model.detokenize([i], special=True).decode("utf-8") for i in ids]}


def main(paths: list[str]) -> None:
    golden = {"source": f"llama-cpp-python {llama_cpp.__version__}, llama_vocab_is_eog over the whole vocabulary",
              "models": {Path(p).name: eog_ids(p) for p in sorted(paths)}}
    out = Path(__file__).with_name("eog_ids.json")
    out.write_text(json.dumps(golden, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
