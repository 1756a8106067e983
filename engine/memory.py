"""How much memory a device has free, to refuse at start a KV cache that cannot fit rather than
be killed by the kernel (or run out on the GPU) once requests fill it. On the CPU a too-large
buffer of zeros allocates fine: its pages are only taken when written, i.e. while serving."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.errors import ConfigError

GIB = 2**30


def free_bytes(device: torch.device) -> int | None:
    """What a new allocation can take now: the GPU's free memory; on the CPU the kernel's
    MemAvailable, or less where a cgroup limit (a container) leaves less. None: unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def ensure_kv_fits(needed: int, device: torch.device, num_tokens: int, *, at_least: bool = False) -> None:
    """Raise ConfigError, naming the flags to lower, when `needed` bytes of KV pool (at_least: a
    lower bound of it) exceed what `device` has free."""
    free = free_bytes(device)
    if free is not None and needed > free:
        raise ConfigError(
            f"the KV pool of {num_tokens} tokens needs {'at least ' if at_least else ''}"
            f"{needed / GIB:.1f} GiB, but {device} has {free / GIB:.1f} GiB free: lower --kv-tokens "
            f"(default --parallel x --ctx)")


def release_freed_memory() -> None:
    """Hand back to the system the pages of large temporaries freed since (loading's dequantized
    matrices, a long prompt's activations and attention gathers): glibc keeps them in the process
    unless asked."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
