"""Which accelerators this host has: `strata serve --devices auto` starts one worker per device."""

from __future__ import annotations


def visible_devices() -> list[str]:
    """Every visible CUDA device (`cuda:0`, ...), else one CPU."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(count)] or ["cpu"]


def parse_devices(spec: str) -> list[str]:
    """`auto`, `cpu`, or a comma list such as `cuda:0,cuda:1` (or `cpu,cpu` for two CPU workers)."""
    spec = spec.strip()
    if spec == "auto":
        return visible_devices()
    devices = [d.strip() for d in spec.split(",") if d.strip()]
    for device in devices:
        if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"unknown device {device!r}: use auto, cpu or cuda:N")
    if not devices:
        raise ValueError("no device given")
    return devices
