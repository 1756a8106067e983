"""The PyTorch side of Strata. Importing this package does not import torch: the API process
uses only `engine.files` and `engine.tokenizer`; `engine.load_engine` pulls torch in."""

from engine.protocol import Engine, SamplingParams

__all__ = ["Engine", "SamplingParams", "load_engine"]


def load_engine(*args, **kwargs):  # noqa: ANN002, ANN003 - thin lazy re-export
    from engine.runner import load_engine as _load

    return _load(*args, **kwargs)
