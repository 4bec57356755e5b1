"""Gemma 3's SentencePiece tokenizer ("llama" GGUF tokenizer model) built from the GGUF's metadata, against
llama.cpp's ids (golden data) and against a line-by-line Python port of llama.cpp's SPM tokenizer."""
import heapq
import json
import random
import time

import pytest

from conftest import DATA

BOS, EOS, END_OF_TURN, START_OF_TURN = 2, 1, 106, 105


@pytest.fixture(scope="session")
def gemma3_golden():
    return json.loads((DATA / "gemma3-270m-q4_k_m.json").read_text())


@pytest.fixture(scope="session")
def gemma3_meta():
    from sharpi.frontend.fetch import fetch
    from sharpi.frontend.gguf_file import GGUFFile
    meta = GGUFFile(fetch("gemma3-270m", show_progress=False)).metadata
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="session")
def gemma3_built(gemma3_meta):
    from sharpi.common.tokenizer import build_from_gguf_metadata
    t0 = time.perf_counter()
    tok, info = build_from_gguf_metadata(gemma3_meta)
    return tok, info, time.perf_counter() - t0


@pytest.fixture(scope="session")
def gemma3_tok(gemma3_built):
    return gemma3_built[0]


def test_metadata_is_sentencepiece_without_space_prefix(gemma3_meta, gemma3_built):
    assert gemma3_meta["tokenizer.ggml.model"] == "llama"
    assert gemma3_meta["tokenizer.ggml.add_space_prefix"] is False
    tok, info, seconds = gemma3_built
    assert (info.model, info.bos_id, info.eos_id, info.add_bos) == ("llama", BOS, EOS, True)
    assert tok.vocab_size == len(gemma3_meta["tokenizer.ggml.tokens"]) == 262144
    assert seconds < 60, f"building the 262144-token tokenizer took {seconds:.1f} s"


def test_golden_strings_tokenize_like_llama_cpp(gemma3_tok, gemma3_golden):
    for case in gemma3_golden["tokenize"]:
        assert gemma3_tok.tokenize(case["text"], add_bos=False, special=True) == case["ids"], case["text"]


def test_golden_strings_round_trip(gemma3_tok, gemma3_golden):
    for case in gemma3_golden["tokenize"]:
        assert gemma3_tok.detokenize(case["ids"], special=True) == case["text"], case["text"]


def test_teacher_forced_text_and_prompts_get_bos_and_golden_ids(gemma3_tok, gemma3_golden):
    tf = gemma3_golden["teacher_forced"]
    assert tf["ids"][0] == BOS
    assert gemma3_tok.tokenize(tf["text"]) == tf["ids"]                  # add_bos=None: the GGUF says add it
    assert gemma3_tok.detokenize(tf["ids"][1:]) == tf["text"]
    for g in gemma3_golden["greedy"]:
        assert gemma3_tok.tokenize(g["prompt"]) == g["prompt_ids"], g["prompt"]
        assert gemma3_tok.detokenize(g["prompt_ids"], special=False) == g["prompt"]
        assert gemma3_tok.detokenize(g["output_ids"], special=False) == g["output_text"]


def test_bos_flag(gemma3_tok):
    assert gemma3_tok.tokenize("a", add_bos=True) == [BOS] + gemma3_tok.tokenize("a", add_bos=False)
    assert gemma3_tok.tokenize("", add_bos=True) == [BOS]
    assert gemma3_tok.tokenize("", add_bos=False) == []


def test_control_tokens_only_with_special(gemma3_tok):
    text = "<start_of_turn>user\nhi<end_of_turn>\n"
    ids = gemma3_tok.tokenize(text, add_bos=False, special=True)
    assert ids[0] == START_OF_TURN and END_OF_TURN in ids
    assert gemma3_tok.is_special(START_OF_TURN) and gemma3_tok.is_special(END_OF_TURN)
    plain = gemma3_tok.tokenize(text, add_bos=False, special=False)
    assert START_OF_TURN not in plain and END_OF_TURN not in plain
    assert gemma3_tok.detokenize(ids, special=True) == text
    assert gemma3_tok.detokenize(ids, special=False) == "user\nhi\n"
    assert gemma3_tok.detokenize(plain) == text


def test_byte_fallback_and_spaces(gemma3_tok):
    ids = gemma3_tok.tokenize("🦙", add_bos=False)
    assert [gemma3_tok.token_text(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert gemma3_tok.detokenize(ids) == "🦙"
    assert gemma3_tok.token_text(gemma3_tok.tokenize(" a", add_bos=False)[0]) == "\u2581a"
    assert gemma3_tok.detokenize(gemma3_tok.tokenize(" a", add_bos=False)) == " a"   # no prefix space added/removed


def test_save_load_keeps_ids(gemma3_built, gemma3_golden, tmp_path):
    from sharpi.common.tokenizer import Tokenizer, TokenizerInfo
    tok, info, _ = gemma3_built
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path, TokenizerInfo.from_dict(info.to_dict()))
    assert loaded.vocab_size == tok.vocab_size
    for case in gemma3_golden["tokenize"]:
        assert loaded.tokenize(case["text"], add_bos=False, special=True) == case["ids"], case["text"]
        assert loaded.detokenize(case["ids"]) == case["text"]
    assert loaded.tokenize(gemma3_golden["teacher_forced"]["text"]) == gemma3_golden["teacher_forced"]["ids"]
    assert loaded.tokenize("<end_of_turn>", add_bos=False, special=True) == [END_OF_TURN]
    assert len(loaded.tokenize("<end_of_turn>", add_bos=False, special=False)) > 1


def test_chat_template_and_stop_ids(gemma3_tok, gemma3_meta):
    from sharpi.common.chat import render_chat
    info = gemma3_tok.info
    from sharpi.common.tokenizer import GEMMA_CHAT_TEMPLATE
    # This GGUF has no tokenizer.chat_template: the tokenizer falls back to llama.cpp's built-in gemma format.
    assert info.chat_template == (gemma3_meta.get("tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    text = render_chat(info.chat_template, messages, bos_token=info.bos_token, eos_token=info.eos_token)
    assert text == ("<start_of_turn>user\nName a colour.<end_of_turn>\n"
                    "<start_of_turn>model\nBlue.<end_of_turn>\n<start_of_turn>model\n")
    with_system = render_chat(info.chat_template, [{"role": "system", "content": "Be brief."}, messages[0]])
    assert with_system == "<start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma3_tok.tokenize(text, special=True)                      # as Model.chat does it
    assert ids[:3] == [BOS, START_OF_TURN, gemma3_tok.tokenize("user", add_bos=False)[0]]
    assert ids.count(BOS) == 1 and ids.count(END_OF_TURN) == 2
    assert gemma3_tok.token_text(END_OF_TURN) == "<end_of_turn>"
    assert EOS in info.stop_ids and END_OF_TURN in info.stop_ids


# --- llama.cpp's SPM tokenizer, ported line by line (src/llama-vocab.cpp: tokenizer_st_partition,
#     llama_vocab::impl::tokenize's LLAMA_VOCAB_TYPE_SPM case, llm_tokenizer_spm_session) ---

class LlamaCppSpm:
    def __init__(self, meta):
        self.tokens = meta["tokenizer.ggml.tokens"]
        self.scores = meta["tokenizer.ggml.scores"]
        self.types = meta["tokenizer.ggml.token_type"]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.add_space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        special = [i for i, ty in enumerate(self.types) if ty in (2, 3, 4)]   # unknown, control, user-defined
        self.special = sorted(special, key=lambda i: -len(self.tokens[i].encode()))

    def tokenize(self, text, parse_special):
        fragments = [text] if text else []
        present = [sid for sid in self.special if self.tokens[sid] in text]   # (a shortcut: the others match nothing)
        for sid in present:
            if not parse_special and self.types[sid] in (2, 3):
                continue
            s = self.tokens[sid]
            new = []
            for f in fragments:
                if isinstance(f, int):
                    new.append(f)
                    continue
                for j, part in enumerate(f.split(s)):
                    if j:
                        new.append(sid)
                    if part:
                        new.append(part)
            fragments = new
        out, prev_special = [], True
        for f in fragments:
            if isinstance(f, int):
                out.append(f)
                prev_special = True
            else:
                out += self._spm((" " if self.add_space_prefix and prev_special else "") + f)
                prev_special = False
        return out

    def _spm(self, text):
        text = text.replace(" ", "\u2581")
        n = len(text)
        length, prev, nxt = [1] * n, list(range(-1, n - 1)), list(range(1, n)) + [-1]
        queue = []

        def try_add_bigram(left, right):
            if left == -1 or right == -1:
                return
            piece = text[left:left + length[left] + length[right]]
            tid = self.vocab.get(piece)
            if tid is not None:   # highest score first, then leftmost
                heapq.heappush(queue, (-self.scores[tid], left, right, len(piece)))

        for i in range(1, n):
            try_add_bigram(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue
            length[left] += length[right]
            length[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add_bigram(prev[left], left)
            try_add_bigram(left, nxt[left])
        out, i = [], 0 if n else -1
        while i != -1:
            piece = text[i:i + length[i]]
            if piece in self.vocab:
                out.append(self.vocab[piece])
            else:
                out += [self.vocab[f"<0x{b:02X}>"] for b in piece.encode()]
            i = nxt[i]
        return out


PIECES = ["the", " the", "The", " lighthouse", " keeper", "ing", "tion", "un", "re", "a", " a", "I", "'s", "n't",
          " ", "  ", "   ", "\u3000", "\n", "\n\n", "\t", "\t\t", "\r\n", "\r", ",", ".", "!", "?", ":", ";", "-",
          "--", "...", "(", ")", "[", "]", "{", "}", "=", "==", "->", "/", "\\", "\"", "'", "`", "```", "#", "*",
          "0", "1", "42", "3.14", "1,000", "2026", "café", "naïve", "Straße", "日本語", "の", "テキスト",
          "中文", "Ελληνικά", "русский", "한국어", "العربية", "हिन्दी", "🦙", "🔥", "👍🏽", "👩\u200d💻",
          "\u200b", "\x00", "\x7f",
          "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "<unused7>",
          "[multimodal]", "<start_of_image>", "<b>", "</b>", "<table>", "<td>", "<0x41>", "<0x", "<", ">", "▁",
          "▁▁", "aaaa", "====", "    def", "lol", "xyzzy", "Supercalifragilisticexpialidocious"]


def _random_texts(n, seed=0):
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.15:
                parts.append("".join(chr(rng.choice([rng.randint(32, 126), rng.randint(0xA0, 0x2FFF),
                                                     rng.randint(0x4E00, 0x9FFF), rng.randint(0x1F300, 0x1FAFF)]))
                                     for _ in range(rng.randint(1, 4))))
            else:
                parts.append(rng.choice(PIECES))
        texts.append("".join(parts))
    return texts


def test_matches_llama_cpp_spm_port(gemma3_tok, gemma3_meta, gemma3_golden):
    ref = LlamaCppSpm(gemma3_meta)
    for case in gemma3_golden["tokenize"]:                     # the port itself reproduces llama.cpp's ids
        assert ref.tokenize(case["text"], parse_special=True) == case["ids"], case["text"]
    assert [BOS] + ref.tokenize(gemma3_golden["teacher_forced"]["text"], False) == \
        gemma3_golden["teacher_forced"]["ids"]
    for text in _random_texts(300) + PIECES:
        for special in (True, False):
            ids = gemma3_tok.tokenize(text, add_bos=False, special=special)
            assert ids == ref.tokenize(text, parse_special=special), (text, special)
            if "\u2581" not in text:         # SentencePiece decodes a literal "\u2581" as " ", as llama.cpp does
                assert gemma3_tok.detokenize(ids) == text, (text, special)


def test_stream_equals_detokenize(gemma3_tok, gemma3_golden):
    """SentencePiece with byte fallback: streamed text (generation's incremental detokenizer) equals a full
    detokenize of the golden strings and of the ids of a multi-byte string fed one at a time."""
    for case in gemma3_golden["tokenize"]:
        stream = gemma3_tok.stream()
        for i in case["ids"]:
            stream.step(i)
        assert stream.text == gemma3_tok.detokenize(case["ids"]), case["text"]
    ids = gemma3_tok.tokenize(" héllo wörld ✓ 日本語 🙂 done", add_bos=False)
    stream = gemma3_tok.stream()
    assert "".join(stream.step(i) for i in ids) == gemma3_tok.detokenize(ids)
