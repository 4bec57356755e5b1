"""The conformance suite as pytest tests: one test per check of sharpi.testing.conformance, each parametrized over
the --sharpi-artifact directories by the plugin (sharpi/testing/pytest_plugin.py), which adds this file to the
run. Not collected on its own: it needs the plugin's fixtures."""
from __future__ import annotations

from .conformance import CHECKS
from .pytest_plugin import run_check


def _make_test(name: str):
    def test(sharpi_suite):
        run_check(sharpi_suite, name)
    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = f"conformance check {name!r} (sharpi.testing.conformance)"
    return test


for _name in CHECKS:
    globals()[f"test_{_name}"] = _make_test(_name)
del _name
