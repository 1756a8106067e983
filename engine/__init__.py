"""The PyTorch side of Strata. Importing this package does not import torch: the API process
uses only `engine.files` and `engine.tokenizer`; `engine.load_engine` pulls torch in."""

import os

# OpenMP threads that wait for work sleep instead of spinning. torch's CPU ops fork and join its
# threads hundreds of times per decode step; with spinning waiters (libgomp's default), any other
# process on the cores (the API streaming tokens, Redis, a client) preempts a thread that a
# spinning partner then waits for, and the step crawls: 2 vs 34-47 tok/s at batch 1 and 8-21 vs
# 90-111 at batch 8 on a loaded 2-core VM (docs/engine.md). Set here, before anything imports
# torch (libgomp reads it once, when it loads); an explicit OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.protocol import Engine, SamplingParams  # noqa: E402

__all__ = ["Engine", "SamplingParams", "load_engine"]


def load_engine(*args, **kwargs):  # noqa: ANN002, ANN003 - thin lazy re-export
    from engine.runner import load_engine as _load

    return _load(*args, **kwargs)
