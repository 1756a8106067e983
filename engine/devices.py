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


# oneDNN's names for the instruction sets it can be limited to (ONEDNN_MAX_CPU_ISA), lowest first,
# with the /proc/cpuinfo flags each needs: one machine can check every kernel family it offers.
ONEDNN_ISAS = (
    ("AVX2", {"avx2", "fma"}),
    ("AVX512_CORE", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    ("AVX512_CORE_BF16", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}),
    ("AVX512_CORE_AMX", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile"}),
)


def onednn_isas(cpuinfo: str | None = None) -> list[str]:
    """The ONEDNN_MAX_CPU_ISA values this CPU offers (oneDNN reads the variable once, at its
    first use in a process: set it before torch runs a kernel, e.g. in a child process)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = next((set(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines() if line.startswith("flags")), set())
    return [name for name, needs in ONEDNN_ISAS if needs <= flags]
