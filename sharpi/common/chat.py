"""Chat prompts rendered with the GGUF's own Jinja chat template (`tokenizer.chat_template`)."""
from __future__ import annotations

from .errors import ConfigError, TokenizerError


def render_chat(template: str | None, messages: list[dict], *, bos_token: str | None = None,
                eos_token: str | None = None, add_generation_prompt: bool = True) -> str:
    if not template:
        raise TokenizerError("This model has no chat template (tokenizer.chat_template is missing in the GGUF).")
    _check_messages(messages)
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ConfigError(f"The chat template refused the messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
        return compiled.render(messages=messages, bos_token=bos_token or "", eos_token=eos_token or "",
                               add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"The GGUF's chat template could not be rendered: {exc}") from None


def _check_messages(messages) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ConfigError("chat() takes a non-empty list of {'role': ..., 'content': ...} messages.")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(f"Each chat message must be a dict with string 'role' and 'content', got {m!r}.")
