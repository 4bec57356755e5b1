"""Tokenizer and detokenizer built from GGUF metadata, held by the `tokenizers` library.

Two GGUF tokenizer models are supported, both rebuilt as `tokenizers` pipelines whose ids equal llama.cpp's:

- "gpt2" (byte-level BPE): GGUF stores the vocabulary, merges, token types and a pre-tokenizer name
  (`tokenizer.ggml.pre`); llama.cpp maps that name to split regexes, and we do the same mapping.
- "llama" (SentencePiece BPE, llama.cpp's LLAMA_VOCAB_TYPE_SPM; Gemma, Llama 2, Mistral): GGUF stores the
  vocabulary with a score per token; see `_sentencepiece_bpe`.

The built tokenizer is serialized to tokenizer.json in the artifact, and the runtime loads it from there (no
GGUF needed at run time).
"""
from __future__ import annotations

import numbers
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from . import schema
from .errors import ConfigError, ContextLengthError, TokenizerError

# Where a generation ends, as llama.cpp decides it (llama-vocab.cpp's end-of-generation set, checked against
# llama_vocab_is_eog on the real test models: tests/test_stop_ids.py): the GGUF's own ids, and tokens found by
# their text, since many GGUFs name only one of a chat model's several end tokens.
END_OF_GENERATION_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "</s>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",           # DeepSeek's, in full-width bars
    # fill-in-the-middle padding and repository / file separators: a chat that reaches one has left its answer
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>"})
MAX_CHAT_TEMPLATE = 1 << 20         # characters; real templates are a few KB
PIECE_CHARS = 1 << 16               # a long text's pieces when checking it against a limit (~40 ms each)
PIECE_SLACK = 4                     # ids a cut between two pieces may add
TOKENIZER_MODELS = ("gpt2", "llama")

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

    @staticmethod
    def check_dict(d, vocab_size: int, path: str = "tokenizer") -> None:
        """A schema.SchemaError unless `d` is tokenizer info sharpi could have written for a vocabulary of
        `vocab_size` (every id it names inside it)."""
        token_id = schema.integer(0, vocab_size - 1)
        piece = schema.optional(schema.text(4096))
        schema.record({"model": schema.one_of(*TOKENIZER_MODELS), "pre": schema.text(64),
                       "bos_id": schema.optional(token_id), "eos_id": schema.optional(token_id),
                       "add_bos": schema.boolean,
                       "stop_ids": schema.array(token_id, 4096, unique=True),
                       "chat_template": schema.optional(schema.text(MAX_CHAT_TEMPLATE)), "bos_token": piece,
                       "eos_token": piece})(d, path)
        if d["add_bos"] and d["bos_id"] is None:
            raise schema.SchemaError(f"{path}.bos_id", "a token id (add_bos is true)", None)


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
    elif model == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise TokenizerError("The GGUF's SentencePiece tokenizer has no tokenizer.ggml.scores for its tokens.")
        hf = _sentencepiece_bpe(tokens, scores, types, meta.get("tokenizer.ggml.unknown_token_id"),
                                add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise TokenizerError(f"Tokenizer model {model!r} is not supported yet "
                             "(sharpi supports gpt2 byte-level BPE and llama SentencePiece BPE).")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    stop_ids = end_of_generation_ids(meta, tokens)
    chat_template = meta.get("tokenizer.chat_template")
    if not chat_template and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        chat_template = GEMMA_CHAT_TEMPLATE     # Gemma GGUFs may carry none; llama.cpp has it built in
    info = TokenizerInfo(
        model=model, pre=meta.get("tokenizer.ggml.pre", "default"), bos_id=bos, eos_id=eos,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)), stop_ids=stop_ids,
        chat_template=chat_template,
        bos_token=tokens[bos] if bos is not None and 0 <= bos < len(tokens) else None,
        eos_token=tokens[eos] if eos is not None and 0 <= eos < len(tokens) else None)
    return Tokenizer(hf, info), info


def end_of_generation_ids(meta: dict, tokens: list[str]) -> list[int]:
    """The ids a generation stops at: tokenizer.ggml.{eos,eot,eom,fim_*}_token_id and every token whose text is
    one of END_OF_GENERATION_TEXTS."""
    ids = {meta.get(f"tokenizer.ggml.{key}_token_id") for key in END_OF_GENERATION_KEYS}
    ids |= {i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TEXTS}
    return sorted(i for i in ids if isinstance(i, int) and 0 <= i < len(tokens))


def _byte_level_bpe(tokens, merges, types, pre: str):

    if pre not in PRE_TOKENIZERS:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(f"Pre-tokenizer {pre!r} is not supported (known: {known}).")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    _check_merges(pairs, vocab)
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=False)
    hf = HFTokenizer(bpe)
    splits, gpt2_regex = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex))
    hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
    hf.decoder = decoders.ByteLevel()
    return _with_added_tokens(hf, tokens, types, special_types=(TOKEN_CONTROL,))


def _check_merges(pairs: list[tuple], vocab: dict) -> None:
    """Each merge joins two tokens into a token of the vocabulary: checked here because the tokenizers library
    fails on a bad one with a bare Exception or a Rust panic (not an Exception) instead of an error to report."""
    for i, pair in enumerate(pairs):
        if len(pair) != 2 or not all(part in vocab for part in pair) or pair[0] + pair[1] not in vocab:
            raise TokenizerError(f"The GGUF's BPE merge {i} ({' '.join(pair)!r}) does not join two tokens of its "
                                 f"vocabulary into a third.")


def _sentencepiece_bpe(tokens, scores, types, unk_id, add_space_prefix: bool):
    """llama.cpp's SPM tokenizer (`llm_tokenizer_spm` in src/llama-vocab.cpp) as a `tokenizers` BPE model.

    llama.cpp, for each text fragment left between special / user-defined tokens: replaces " " by "▁", splits
    the text into characters, then repeatedly merges the adjacent pair whose concatenation is a vocabulary token
    with the highest score (ties: the leftmost pair), until no pair forms a token; a remaining character that is
    not a token is emitted as its UTF-8 byte tokens <0xNN>. A BPE model does the same when its merges are every
    split (a, b) of every token a+b into two tokens, ranked by the merged token's score (highest first): BPE also
    merges the lowest-ranked adjacent pair, leftmost first, and only merged symbols or single characters can be
    symbols in either algorithm. byte_fallback=True gives the <0xNN> tokens for characters outside the vocabulary.
    What a rank list cannot express (never met on the tested Gemma 3 vocabulary, whose normal tokens have distinct
    scores): llama.cpp breaks a tie between two *different* tokens of equal score by position, BPE by rank (here:
    by token id); and llama.cpp can merge a character outside the vocabulary with a neighbour when the pair is a
    token, which byte fallback has already turned into bytes (Gemma 3: only " " is such a character, and it
    only appears in user-defined tokens that are split off before the BPE, so it never reaches it).

    Around the model: user-defined tokens (type 4) are always split off the raw text first (llama.cpp's
    `tokenizer_st_partition`), control and unknown tokens (types 3, 2) only when special=True (the matching
    differs from llama.cpp's only for overlapping token texts: it takes the longest token first anywhere in the
    text, `tokenizers` the leftmost-longest match). `tokenizer.ggml.add_space_prefix` (true unless the GGUF says
    otherwise; Gemma says false) makes llama.cpp put a space before every text fragment (each one starts the
    text or follows a special token), as the Prepend normalizer does here. Decoding: "▁" -> " ",
    <0xNN> -> bytes, the pieces of llama.cpp's token_to_piece; llama.cpp's llama_detokenize also drops the
    leading space of a text starting with a "▁" token on add_space_prefix models, which is not done here
    (so that decoding a generated continuation keeps its first space).
    """

    vocab = {tok: i for i, tok in enumerate(tokens)}      # a repeated text maps to its last id, as in llama.cpp
    ranked = []
    for tok, i in vocab.items():
        for k in range(1, len(tok)):
            left = tok[:k]
            if left in vocab:
                right = tok[k:]
                if right in vocab:
                    ranked.append((-scores[i], i, left, right))
    ranked.sort(key=lambda m: (m[0], m[1]))
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked], unk_token=unk,
                                fuse_unk=False, byte_fallback=True, ignore_merges=False))
    escape = normalizers.Replace(" ", "▁")         # llama_escape_whitespace
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if add_space_prefix else escape
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return _with_added_tokens(hf, tokens, types, special_types=(TOKEN_CONTROL, TOKEN_UNKNOWN))


def _with_added_tokens(hf, tokens, types, special_types: tuple):
    """Register the tokens split off before the model: `special_types` as special tokens (matched only with
    special=True), user-defined ones always."""

    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special_types]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)
    return hf


# llama.cpp's built-in "gemma" chat format (llm_chat_apply_template, LLM_CHAT_TEMPLATE_GEMMA), used when a Gemma
# GGUF has no tokenizer.chat_template: "assistant" is "model", system text goes before the first user turn.
# No BOS here: chat prompts are tokenized with the GGUF's add_bos flag, which adds it.
GEMMA_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + (message['content'] | trim) -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if ns.system and role != 'model' -%}{{ ns.system + '\\n\\n' }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


class Tokenizer:
    """tokenize / detokenize with llama.cpp's conventions (special tokens parsed when special=True). Safe to use
    from several threads at once: each way of matching special tokens has its own `tokenizers` object, and no
    call changes any state."""

    def __init__(self, hf, info: TokenizerInfo):
        self._hf = hf                      # special tokens matched in the text (special=True); decoding
        self._hf_plain = None              # a copy that reads special tokens' texts as text, made on first use
        self._plain_lock = threading.Lock()
        self.info = info
        self._special_ids = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self._vocab_size = hf.get_vocab_size(with_added_tokens=True)   # costs ~1 ms on a 262144-token vocabulary
        self._longest_token = None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Whether both map every token text to the same id (a draft model's tokens mean the model's)."""
        return self.vocab_size == other.vocab_size and \
            self._hf.get_vocab(with_added_tokens=True) == other._hf.get_vocab(with_added_tokens=True)

    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False,
                 limit: int | None = None) -> list[int]:
        """Text to ids. add_bos=None follows the GGUF's add_bos_token flag; special=True parses special tokens.
        limit: a PromptTooLongError (a ContextLengthError) for a text of more than `limit` ids, BOS included,
        found without tokenizing the whole of a text far over it (see _check_within)."""
        if not isinstance(text, str):
            raise TokenizerError(f"tokenize() takes a str, got {type(text).__name__}.")
        if add_bos is None:
            add_bos = self.info.add_bos
        bos = [self.info.bos_id] if add_bos and self.info.bos_id is not None else []
        encoder = self._encoder(special)
        if limit is not None:
            self._check_within(encoder, text, limit - len(bos))
        ids = bos + encoder.encode(text, add_special_tokens=False).ids
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(len(ids), limit, exact=True)
        return ids

    def _encoder(self, special: bool):
        if special:
            return self._hf
        if self._hf_plain is None:
            with self._plain_lock:
                if self._hf_plain is None:
                    # The tokenizers library always matches added tokens unless encode_special_tokens is set; a
                    # flag toggled around each call on a shared object is wrong under threads, so the plain
                    # encoder is a copy with the flag set once (llama.cpp's special=False: "<|im_start|>" in user
                    # text is text).
                    plain = HFTokenizer.from_str(self._hf.to_str())
                    plain.encode_special_tokens = True
                    self._hf_plain = plain
        return self._hf_plain

    @property
    def longest_token(self) -> int:
        """The most characters of text one token can stand for: its piece's length (a byte-level piece has a
        character a byte, a SentencePiece piece at least a character for each it covers)."""
        if self._longest_token is None:
            self._longest_token = max(len(piece) for piece in self._hf.get_vocab(with_added_tokens=True))
        return self._longest_token

    def _check_within(self, encoder, text: str, limit: int) -> None:
        """A PromptTooLongError if `text` is sure to be more than `limit` ids, decided cheaply: a text longer than
        limit x longest_token characters is refused untokenized; a long one is tokenized in pieces (cut before a
        space) until their ids pass the limit. Cutting can change a few ids at each cut (a SentencePiece piece's
        space prefix, a token that spanned it), so the pieces must pass the limit by PIECE_SLACK ids a cut."""
        if len(text) > max(limit, 0) * self.longest_token:
            raise PromptTooLongError(-(-len(text) // self.longest_token), limit)
        if len(text) <= limit * 4:          # at most ~4x the ids of typical text: tokenized whole, cheaply
            return
        count = 0
        for cuts, piece in enumerate(_pieces(text, PIECE_CHARS)):
            count += len(encoder.encode(piece, add_special_tokens=False).ids)
            if count > limit + PIECE_SLACK * cuts:
                raise PromptTooLongError(count - PIECE_SLACK * cuts, limit)

    def detokenize(self, ids, special: bool = True) -> str:
        """Ids to text; special=True renders special tokens as their text so tokenize/detokenize round-trip."""
        ids = self._checked_ids(ids)
        return self._hf.decode(ids, skip_special_tokens=not special)

    def _checked_ids(self, ids) -> list[int]:
        """The ids as ints, or TokenizerError naming the first one that is not an integer or outside the
        vocabulary."""
        ids = token_ids(ids, "detokenize()")
        size = self._vocab_size
        bad = [i for i in ids if not 0 <= i < size]
        if bad:
            raise TokenizerError(f"Token id {bad[0]} is outside the vocabulary (size {self.vocab_size}).")
        return ids

    def stream(self, special: bool = True) -> "TextStream":
        """An incremental detokenizer for a growing list of ids (generation): each step decodes only a short tail,
        where detokenize(all ids so far) every step would cost O(n^2) over a long generation."""
        return TextStream(self, special)

    def token_text(self, token_id: int) -> str:
        return self._hf.id_to_token(int(token_id))

    def is_special(self, token_id: int) -> bool:
        return int(token_id) in self._special_ids

    def save(self, directory: Path) -> None:
        self._hf.save(str(Path(directory) / "tokenizer.json"))

    @classmethod
    def load(cls, directory: Path, info: TokenizerInfo) -> "Tokenizer":
        """The tokenizer saved in an artifact; a file the `tokenizers` library cannot read is a TokenizerError."""
        path = Path(directory) / "tokenizer.json"
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:     # the library raises plain Exceptions with multi-line messages
            reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
            raise TokenizerError(f"{path} cannot be read by the tokenizers library "
                                 f"({schema.shown(reason, 120)}).") from None
        return cls(hf, info)


class TextStream:
    """Text of ids fed one at a time, equal to Tokenizer.detokenize of all of them: `tokenizers`' DecodeStream
    (it holds back an incomplete UTF-8 character or byte-fallback sequence until it is whole)."""

    def __init__(self, tokenizer: Tokenizer, special: bool):

        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=not special)
        self.text = ""

    def step(self, token_id: int) -> str:
        """Feed one id; returns the text it completed (possibly empty). `.text` holds everything so far."""
        [token_id] = self._tokenizer._checked_ids([token_id])
        piece = self._stream.step(self._tokenizer._hf, token_id) or ""
        self.text += piece
        return piece


class PromptTooLongError(ContextLengthError):
    """A text of more ids than a limit: `tokens` is their count when `exact`, else a lower bound on it."""

    def __init__(self, tokens: int, limit: int, exact: bool = False):
        self.tokens, self.limit, self.exact = tokens, limit, exact
        count = f"{tokens}" if exact else f"at least {tokens}"
        super().__init__(f"The text has {count} tokens, more than the {limit} allowed.")


def _pieces(text: str, size: int):
    """`text` in pieces of about `size` characters, each cut just before a space that follows a non-space (where
    a pre-tokenizer splits words), or at `size` where the last eighth of the piece has no such space."""
    start = 0
    while start < len(text):
        end = start + size
        if end < len(text):
            cut = text.rfind(" ", end - size // 8, end)
            while cut > start and text[cut - 1].isspace():
                cut = text.rfind(" ", end - size // 8, cut)
            end = cut if cut > start else end
        yield text[start:end]
        start = end


def token_ids(ids, what: str) -> list[int]:
    """A sequence of token ids as a list of ints: Python or numpy integers only (not bools, floats, bytes or a
    str, which iterate into something else), or a ConfigError saying what `what` takes and was given."""


    wrong = f"{what} must be a sequence of integer token ids, got {type(ids).__name__}"
    if isinstance(ids, (str, bytes, bytearray, memoryview, dict)) or isinstance(ids, np.ndarray) and ids.ndim != 1:
        raise ConfigError(f"{wrong}.")
    try:
        items = list(ids)
    except TypeError:
        raise ConfigError(f"{wrong}.") from None
    for i in items:
        if isinstance(i, (bool, np.bool_)) or not isinstance(i, numbers.Integral):
            raise ConfigError(f"{what} must hold integer token ids, got {schema.shown(i)} ({type(i).__name__}).")
    return [int(i) for i in items]
