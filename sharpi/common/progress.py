"""One progress-bar helper, so every long step (fetch, repack, compile, eval) looks the same."""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def progress_bar(total: int, desc: str, enabled: bool = True, unit: str = "B"):
    """A tqdm bar on stderr (bytes by default); a no-op object when disabled or tqdm is missing."""
    if enabled:
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is a dependency, but a bar is never worth a crash
            enabled = False
    if not enabled:
        yield _NoBar()
        return
    scale = unit == "B"
    with tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
              file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield bar


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass
