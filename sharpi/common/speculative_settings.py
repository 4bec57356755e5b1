"""Speculative decoding's settings: which drafter proposes tokens, and how many one verification checks at most.
Parsed here (not in the runtime) so that a server's HTTP front checks a request's value without the model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from .errors import ConfigError
from .settings import parse_int

# off: one token a forward; lookup: drafts copied from where the last tokens occurred before in the prompt or
# output (prompt lookup decoding); draft: a smaller model of the same vocabulary drafts them
METHODS = ("off", "lookup", "draft")
MAX_DRAFT = 64       # drafted tokens one verification may check (a forward of draft + 1 tokens)
MAX_NGRAM = 16


@dataclass(frozen=True)
class SpeculativeSettings:
    method: str = "off"
    max_draft: int = 16         # the most drafted tokens one forward verifies
    ngram_max: int = 4          # prompt lookup: the longest run of last tokens looked up
    ngram_min: int = 2          # and the shortest (1 matches too often to pay)
    adaptive: bool = True       # draft as many as pay by the measured acceptance and forward times (else max)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def on(self) -> bool:
        return self.method != "off"

    def validate(self) -> "SpeculativeSettings":
        if self.method not in METHODS:
            raise ConfigError(f"speculative must be one of {', '.join(METHODS)}, got {self.method!r}.")
        max_draft = parse_int(self.max_draft, "max_draft", 1, MAX_DRAFT, text=False)
        ngram_max = parse_int(self.ngram_max, "ngram_max", 1, MAX_NGRAM, text=False)
        ngram_min = parse_int(self.ngram_min, "ngram_min", 1, ngram_max, text=False)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"adaptive must be True or False, got {self.adaptive!r}.")
        return replace(self, max_draft=max_draft, ngram_max=ngram_max, ngram_min=ngram_min)


def speculative_settings(value, *, draft: bool = False) -> SpeculativeSettings:
    """The settings a user's value names: None (off, or "draft" where a draft model was given), a method name, a
    dict of SpeculativeSettings' fields, or SpeculativeSettings; checked (one ConfigError naming the value)."""
    if value is None:
        value = "draft" if draft else "off"
    if isinstance(value, str):
        settings = SpeculativeSettings(method=value.strip().lower())
    elif isinstance(value, dict):
        unknown = set(value) - {f.name for f in fields(SpeculativeSettings)}
        if unknown:
            raise ConfigError(f"Unknown speculative setting(s): {', '.join(sorted(map(str, unknown)))}.")
        settings = SpeculativeSettings(**{"method": "draft" if draft else "lookup", **value})
    elif isinstance(value, SpeculativeSettings):
        settings = value
    else:
        raise ConfigError(f"speculative must be a method name ({', '.join(METHODS)}), a dict or SpeculativeSettings, "
                          f"got {type(value).__name__}.")
    settings = settings.validate()
    if draft and settings.method != "draft":
        raise ConfigError(f"A draft model drafts with speculative 'draft', not {settings.method!r}.")
    if settings.method == "draft" and not draft:
        raise ConfigError("speculative 'draft' needs a draft model (draft=DIR, or --draft DIR).")
    return settings


def check_model_can_speculate(settings: SpeculativeSettings, config) -> SpeculativeSettings:
    """settings, unless they ask a hybrid model (a ModelConfig with recurrent layers) to speculate: verifying
    drafts means rolling back the rejected ones, and a recurrent state keeps no history to roll back to."""
    if settings.on and config.is_hybrid:
        raise ConfigError(f"Speculative decoding rolls back rejected drafts, which this {config.arch} model's "
                          f"recurrent state cannot do; use speculative off.")
    return settings
