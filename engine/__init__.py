"""The PyTorch side of Strata. Importing this package does not import torch: the API process
uses only `engine.files` and `engine.tokenizer`; `engine.load_engine` pulls torch in."""

import os

# How torch's OpenMP threads wait between the few hundred parallel regions of an eager step:
# spin briefly, then sleep. libgomp's default spin (300 000 turns) or OMP_WAIT_POLICY=ACTIVE is
# fastest alone on the cores but crawls when anything else wants them (a preempted partner is
# waited for through whole time slices: 2 vs 34-47 tok/s at batch 1 on a loaded 2-core VM);
# sleeping at once (PASSIVE) pays a futex wake-up at every region, which halves a quiet machine's
# speed (49 vs 86 tok/s at batch 1). 2 000 turns (tens of microseconds) bridges the gap between
# two regions of one step and gives up soon after (measurements: docs/engine.md). Set here,
# before anything imports torch (libgomp reads both once, when it loads); an explicit
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
OPENMP_SPIN = "2000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # the spin count below bounds the waiting instead
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN

from engine.protocol import Engine, SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams", "load_engine"]


def load_engine(*args, **kwargs):  # noqa: ANN002, ANN003 - thin lazy re-export
    from engine.load import load_engine as _load

    return _load(*args, **kwargs)
