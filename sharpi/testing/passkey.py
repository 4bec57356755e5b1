"""The passkey retrieval prompt of llama.cpp's examples/passkey. It lives in sharpi.eval.tasks with the other
long-context prompts; re-exported here for tests/test_snapkv_retrieval.py and benchmarks/gemma3_passkey.py."""
from __future__ import annotations

from ..eval.tasks import FILLER, INTRO, QUESTION, passkey_prompt, passkey_trials

__all__ = ["INTRO", "FILLER", "QUESTION", "passkey_prompt", "passkey_trials"]
