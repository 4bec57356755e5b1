"""Tokenizer and detokenizer built from GGUF metadata, held by the `tokenizers` library.

GGUF stores a byte-level BPE as its vocabulary, merges, token types and a pre-tokenizer name
(`tokenizer.ggml.pre`); llama.cpp maps that name to split regexes. We do the same mapping onto a
`tokenizers` pipeline, so the ids equal llama.cpp's. The built tokenizer is serialized to tokenizer.json
in the artifact, and the runtime loads it from there (no GGUF needed at run time).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import TokenizerError

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split regexes llama.cpp applies before byte-level BPE, by `tokenizer.ggml.pre`. Each list runs in order,
# every regex isolating its matches. The last regex of each is GPT-2's, which ByteLevel(use_regex=True) applies.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    # name: (extra split regexes before the GPT-2 byte-level split, whether ByteLevel applies GPT-2's regex)
    "smollm": ([r"\p{N}"], True),
    "gpt2": ([], True),
    "default": ([], True),
    "llama-bpe": ([_LLAMA3_REGEX], False),
    "llama3": ([_LLAMA3_REGEX], False),
    "qwen2": ([_QWEN2_REGEX], False),
}


@dataclass
class TokenizerInfo:
    """What the manifest records about the tokenizer besides tokenizer.json."""
    model: str
    pre: str
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    stop_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TokenizerInfo":
        return cls(**d)


def build_from_gguf_metadata(meta: dict) -> tuple["Tokenizer", TokenizerInfo]:
    """Build the tokenizer from a GGUF's `tokenizer.ggml.*` fields (already decoded to Python values)."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerError("The GGUF has no tokenizer (tokenizer.ggml.model / tokens are missing).")
    types = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if model == "gpt2":
        hf = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], types,
                             meta.get("tokenizer.ggml.pre", "default"))
    else:
        raise TokenizerError(f"Tokenizer model {model!r} is not supported yet (sharpi supports gpt2 byte-level BPE).")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    stop_ids = sorted({i for i in (eos, meta.get("tokenizer.ggml.eot_token_id")) if i is not None}
                      | {i for i, t in enumerate(tokens) if t in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")})
    info = TokenizerInfo(
        model=model, pre=meta.get("tokenizer.ggml.pre", "default"), bos_id=bos, eos_id=eos,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)), stop_ids=stop_ids,
        chat_template=meta.get("tokenizer.chat_template"),
        bos_token=tokens[bos] if bos is not None and 0 <= bos < len(tokens) else None,
        eos_token=tokens[eos] if eos is not None and 0 <= eos < len(tokens) else None)
    return Tokenizer(hf, info), info


def _byte_level_bpe(tokens, merges, types, pre: str):
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(f"Pre-tokenizer {pre!r} is not supported (known: {known}).")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                ignore_merges=False))
    splits, gpt2_regex = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
    return hf


class Tokenizer:
    """tokenize / detokenize with llama.cpp's conventions (special tokens parsed when special=True)."""

    def __init__(self, hf, info: TokenizerInfo):
        self._hf = hf
        self.info = info
        self._special_ids = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Text to ids. add_bos=None follows the GGUF's add_bos_token flag; special=True parses special tokens."""
        if not isinstance(text, str):
            raise TokenizerError(f"tokenize() takes a str, got {type(text).__name__}.")
        if special:
            ids = self._hf.encode(text, add_special_tokens=False).ids
        else:
            ids = self._encode_without_special_parsing(text)
        if add_bos is None:
            add_bos = self.info.add_bos
        if add_bos and self.info.bos_id is not None:
            ids = [self.info.bos_id] + ids
        return ids

    def _encode_without_special_parsing(self, text: str) -> list[int]:
        # The tokenizers library always matches added tokens; to treat "<|im_start|>" in user text as plain
        # text (llama.cpp's special=False), encode with added-token matching switched off for this call.
        self._hf.encode_special_tokens = True
        try:
            return self._hf.encode(text, add_special_tokens=False).ids
        finally:
            self._hf.encode_special_tokens = False

    def detokenize(self, ids, special: bool = True) -> str:
        """Ids to text; special=True renders special tokens as their text so tokenize/detokenize round-trip."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"Token id {bad[0]} is outside the vocabulary (size {self.vocab_size}).")
        return self._hf.decode(ids, skip_special_tokens=not special)

    def token_text(self, token_id: int) -> str:
        return self._hf.id_to_token(int(token_id))

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def save(self, directory: Path) -> None:
        self._hf.save(str(Path(directory) / "tokenizer.json"))

    @classmethod
    def load(cls, directory: Path, info: TokenizerInfo) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_file(str(Path(directory) / "tokenizer.json")), info)
