"""The Vulkan tests' shared entry: open the device (or skip where there is none, except in CI, which installs
lavapipe and must fail without it) and replay Relax modules through the plan runner."""
from __future__ import annotations

import os

import pytest


def on_vulkan(open_device):
    """open_device() (a loader that opens a Vulkan device), or a skip with the reason when no device exists."""
    from sharpi.runtime.vulkan import VulkanUnavailableError
    try:
        return open_device()
    except VulkanUnavailableError as exc:
        if os.environ.get("CI"):
            raise                      # CI installs lavapipe: a missing device there is a failure
        pytest.skip(f"no Vulkan device here: {exc}")


def plan_runner(mod, directory):
    """Build `mod` to a Vulkan plan in `directory` and open a runner on it."""
    from sharpi.codegen.targets.vulkan import build_plan, write_plan
    from sharpi.runtime.vulkan import VulkanPlanRunner
    write_plan(build_plan(mod), directory)
    return on_vulkan(lambda: VulkanPlanRunner(directory))
