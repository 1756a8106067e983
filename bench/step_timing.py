"""The model-level timing loop the speed benches share (bench/models_speed.py, bench/quant_speed.py):
every slot holds `context` tokens, then decode steps of 1..B rows (one token a row, the step's
own argmax fed back) and one prompt chunk, timed wall and CPU (all threads). Model level: no
tokenizer, no worker, eager. The context and the prompt go through `CacheIndex.for_slots` rows
(as both benches measured before sharing this loop), so a prompt is timed through the decode
forms; a recurrent model's state advances with them like its K/V."""

from __future__ import annotations

from dataclasses import dataclass
import time

import torch

from engine.model import CacheIndex, Transformer

SPAN = 256  # decode attends over the context rounded up to this, as engine/runner.py's KV_BUCKET


@dataclass
class Timing:
    wall_s: float  # median of the steps after the first (a prompt: its one chunk)
    cpu_s: float  # likewise, CPU time of all threads

    def per_second(self, tokens: int) -> float:
        return tokens / self.wall_s


def measure(model: Transformer, batches: list[int], steps: int, context: int, prompt: int,
            seed: int = 0) -> tuple[dict[int, Timing], Timing]:
    """-> ({batch: a decode step's timing}, the prompt chunk's timing). The model's cache must hold
    max(batches) slots of context + steps + 1 + prompt positions."""
    vocab = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    decode: dict[int, Timing] = {}
    with torch.inference_mode():
        for s in range(max(batches)):  # `context` tokens in every slot
            ids = torch.randint(0, vocab, (1, context), generator=gen)
            model(ids, CacheIndex.for_slots([s], torch.arange(context).unsqueeze(0), context))
        for batch in batches:
            rows = list(range(batch))
            tokens = torch.randint(0, vocab, (batch, 1), generator=gen)
            times, cpu = [], []
            for step in range(steps + 1):
                pos = torch.full((batch, 1), context + step)
                started, used = time.perf_counter(), time.process_time()
                h = model(tokens, CacheIndex.for_slots(rows, pos, SPAN * ((context + step) // SPAN + 1)))
                tokens = model.logits(h).argmax(-1, keepdim=True)
                times.append(time.perf_counter() - started)
                cpu.append(time.process_time() - used)
            decode[batch] = Timing(_median(times[1:]), _median(cpu[1:]))
        start = context + steps + 1  # slot 0's prompt after its context and its decoded positions
        ids = torch.randint(0, vocab, (1, prompt), generator=gen)
        started, used = time.perf_counter(), time.process_time()
        model(ids, CacheIndex.for_slots([0], torch.arange(start, start + prompt).unsqueeze(0), start + prompt))
        read = Timing(time.perf_counter() - started, time.process_time() - used)
    return decode, read


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
