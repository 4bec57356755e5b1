"""What this CPU can run: /proc/cpuinfo's flags, except AMX unless the operating system grants it.

AMX's tile data is 8 KB of register state, so Linux (5.16 on) leaves it disabled for a process until the process
asks with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); a kernel or hypervisor may refuse although
/proc/cpuinfo lists amx_tile (llama.cpp's native build died with SIGILL on such a Xeon, 2026-12-01). A flag list
alone would promise instructions that fault, so AMX counts only once the request is granted.
"""
from __future__ import annotations

import ctypes
import functools
import platform
import sys

AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "amx_complex"})

_SYS_ARCH_PRCTL = 158            # x86-64 syscall number
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def host_cpu_flags() -> set[str]:
    """/proc/cpuinfo's flags (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def amx_granted() -> bool:
    """Whether this process may use AMX tiles: the kernel granted XTILEDATA when asked (the request stays in
    force for the process, as it must for any AMX code it runs). False off x86-64 Linux and on any refusal."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
            return False
        permitted = ctypes.c_uint64(0)
        if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(permitted)) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return bool(permitted.value >> _XFEATURE_XTILEDATA & 1)


def usable_cpu_flags() -> set[str]:
    """The flags code may rely on here: host_cpu_flags, without AMX's unless amx_granted."""
    flags = host_cpu_flags()
    if flags & AMX_FLAGS and not amx_granted():
        flags = flags - AMX_FLAGS
    return flags
