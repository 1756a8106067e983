"""Build and load the engine's C++ torch op libraries: the quantized-matrix kernels (dequant.cpp,
kernel.cpp, prompt.cpp, ops.cpp: `strata_quants`) and the decode attention over the KV pool (engine/attend.cpp:
`strata_attend`).

`make install` runs `python -m engine.quants.build`; a process that finds no library for the
current sources (a checkout updated since) builds it then, once (~1 minute on 2 cores). g++ is
called directly with torch's include and library folders (torch.utils.cpp_extension's lists), so
neither ninja nor setuptools is needed. The library's name carries a hash of the sources, the
flags and torch's version: a stale one is never loaded. Without a C++ compiler nothing is built
and `load()` says why; the loader then dequantizes those types to bf16 as before."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = ("layouts.h", "isa.h", "dequant.cpp", "repack.cpp", "kernel.cpp", "prompt.cpp", "prompt_int8.cpp", "prompt_bf16.cpp", "ops.cpp")  # all hashed into the library's name
X86 = platform.machine() in ("x86_64", "AMD64")
# (object, source, flags). dequant.cpp must not fuse a product and a sum (numpy rounds each):
# bit-exact unpacking. kernel.cpp and prompt.cpp twice: AVX2 + FMA (picked at run time where the
# CPU has them, AMD and Intel alike) and the baseline; kernel.cpp a third time with AVX-512 VNNI
# (the same bits, picked where the CPU has it); prompt_int8.cpp with AVX2 and with VNNI (the same
# bits), prompt_bf16.cpp with AVX-512 BF16 alone (its only use); ops.cpp must know whether the AVX2
# ones exist.
UNITS = [("dequant", "dequant.cpp", ["-ffp-contract=off"]),
         ("repack", "repack.cpp", []),
         ("kernel", "kernel.cpp", []),
         *([("kernel_avx2", "kernel.cpp", ["-DSTRATA_AVX2", "-mavx2", "-mfma", "-mf16c"])] if X86 else []),
         *([("kernel_vnni", "kernel.cpp", ["-DSTRATA_AVX2", "-DSTRATA_VNNI", "-mavx2", "-mfma", "-mf16c",
                                            "-mavx512vl", "-mavx512vnni"])] if X86 else []),
         ("prompt", "prompt.cpp", []),
         *([("prompt_avx2", "prompt.cpp", ["-DSTRATA_AVX2", "-mavx2", "-mfma", "-mf16c"])] if X86 else []),
         *([("prompt_int8_avx2", "prompt_int8.cpp", ["-DSTRATA_AVX2", "-mavx2", "-mfma", "-mf16c"])] if X86 else []),
         *([("prompt_int8", "prompt_int8.cpp", ["-DSTRATA_AVX2", "-DSTRATA_VNNI", "-mavx2", "-mfma", "-mf16c",
                                                "-mavx512vl", "-mavx512vnni"])] if X86 else []),
         *([("prompt_bf16", "prompt_bf16.cpp", ["-DSTRATA_AVX2", "-DSTRATA_BF16", "-mavx2", "-mfma", "-mf16c",
                                                "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512bf16"])] if X86 else []),
         ("ops", "ops.cpp", ["-fopenmp", *(["-DSTRATA_HAVE_AVX2"] if X86 else [])])]
COMMON = ["-O3", "-std=c++20", "-fPIC", "-fno-math-errno"]
BUILD_DIR = HERE / "_build"
# engine/attend.cpp: one unit; its x86 AVX2 build (a function built for AVX2 and F16C beside the
# baseline one) is picked at run time, and no fused multiply-add, so both give the same bits.
ATTEND = HERE.parent / "attend.cpp"
ATTEND_FLAGS = ["-fopenmp", "-ffp-contract=off", "-Wno-psabi"]  # psabi: v8 in the baseline build, always inlined


def _torch_flags() -> tuple[list[str], list[str]]:
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch.compiled_with_cxx11_abi())
    compile_flags = [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"] + [f"-I{p}" for p in include_paths()]
    libs = library_paths()
    link = [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu", "-ltorch", "-fopenmp"]
    return compile_flags, link


def _units(library: str) -> tuple[list[Path], list[tuple[str, Path, list[str]]]]:
    """A library's hashed sources and its (object, source, flags) units."""
    if library == "strata_attend":
        return [ATTEND, HERE / "isa.h"], [("attend", ATTEND, ATTEND_FLAGS)]
    return [HERE / name for name in SOURCES], [(unit, HERE / name, flags) for unit, name, flags in UNITS]


def library_path(library: str = "strata_quants") -> Path:
    sources, units = _units(library)
    h = hashlib.sha1(torch.__version__.encode())
    for path in sources:
        h.update(path.read_bytes())
    h.update(repr(([(u, p.name, f) for u, p, f in units], COMMON)).encode())
    return BUILD_DIR / f"{library}-{h.hexdigest()[:12]}.so"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(library: str = "strata_quants") -> Path:
    """Compile the library if it is not there yet; its path."""
    target = library_path(library)
    if target.exists():
        return target
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++) found: install one to keep K-quants/IQ quants quantized")
    compile_flags, link = _torch_flags()
    BUILD_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=BUILD_DIR) as tmp:
        objects = []
        for unit, path, flags in _units(library)[1]:
            obj = Path(tmp) / (unit + ".o")
            extra = compile_flags if path.name in ("ops.cpp", "attend.cpp") else []  # those include torch
            subprocess.run([cxx, *COMMON, *flags, *extra, "-c", str(path), "-o", str(obj)], check=True)
            objects.append(str(obj))
        out = Path(tmp) / target.name
        subprocess.run([cxx, "-shared", *objects, "-o", str(out), *link], check=True)
        out.replace(target)  # whole or absent, even with several workers building at once
    return target


# what runs instead where a library cannot be built or loaded
WITHOUT = {"strata_quants": "those GGUF types are dequantized to bf16",
           "strata_attend": "a decode step gathers the pool's rows first"}


@cache
def load(library: str = "strata_quants") -> str | None:
    """Load a library's ops into torch.ops.<library> (building it if needed), with their fake
    kernels (fake.py). None on success, else why they are not available."""
    try:
        torch.ops.load_library(str(build(library)))
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        log.warning("%s unavailable (%s): %s", library, e, WITHOUT[library])
        return str(e)
    from engine.quants import fake

    fake.register(library)  # before any trace of the decode step (engine/compiled.py, engine/aot.py)
    return None


if __name__ == "__main__":
    if compiler() is None:  # `make install` still succeeds: those types are dequantized to bf16
        print("engine/quants: no C++ compiler (g++): K-quant/IQ GGUF types will be dequantized to bf16",
              file=sys.stderr)
        sys.exit(0)
    for name in ("strata_quants", "strata_attend"):
        path = build(name)
        torch.ops.load_library(str(path))
        print(f"built {path}", file=sys.stderr)
