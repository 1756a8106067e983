"""Strata's model against a transformers model on the same weights, in float32, as every family's
tests do it: a prompt read in uneven chunks, then batched decode in scattered slots."""

from __future__ import annotations

import torch

from tests.engine.conftest import decode_logits, prefill_logits

ATOL = 2e-4  # float32 logits; observed differences ~1e-5 (op order only)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


def check_prefill_and_decode(hf, model, vocab: int = 256, atol: float = ATOL, prompt: int = 70) -> None:
    """A `prompt`-token prompt read into slot 2 in chunks of 16, 1, 33, ... tokens, each chunk's
    last logits against transformers'; then slots 3 and 1 (out of order: the gathered path) read
    prompts of 50 and 9 tokens and decode 4 tokens side by side, every step against transformers'."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    ref = hf_logits(hf, ids)
    start = 0
    for chunk in (16, 1, 33, prompt):
        chunk = min(chunk, prompt - start)
        if chunk <= 0:
            break
        logits = prefill_logits(model, 2, ids[start:start + chunk], start)
        start += chunk
        torch.testing.assert_close(logits, ref[start - 1], atol=atol, rtol=0)
    prompts = {3: ids[:50], 1: ids[5:14]}
    extra = torch.randint(0, vocab, (2, 4), generator=gen).tolist()
    refs = {s: hf_logits(hf, prompts[s] + extra[row]) for row, s in enumerate(prompts)}
    for slot, tokens in prompts.items():
        prefill_logits(model, slot, tokens)
    for step in range(4):
        positions = [len(prompts[s]) + step for s in prompts]
        logits = decode_logits(model, list(prompts), [extra[row][step] for row in range(2)], positions)
        for row, slot in enumerate(prompts):
            torch.testing.assert_close(logits[row], refs[slot][positions[row]], atol=atol, rtol=0)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


def check_engine_greedy(hf, model, vocab: int = 256, steps: int = 6) -> None:
    """The engine as a worker drives it (begin, read, decode of several slots side by side, out of
    slot order): every slot's greedy tokens are transformers' greedy tokens for its prompt."""
    from engine.protocol import SamplingParams
    from engine.runner import TorchEngine

    engine = TorchEngine(model, None, eos_token_ids=frozenset())
    gen = torch.Generator().manual_seed(3)
    prompts = {3: torch.randint(0, vocab, (30,), generator=gen).tolist(), 0: torch.randint(0, vocab, (7,), generator=gen).tolist(),
               2: torch.randint(0, vocab, (18,), generator=gen).tolist()}
    out = {}
    for slot, prompt in prompts.items():
        engine.begin(slot, SamplingParams(temperature=0.0))
        out[slot] = [engine.read(slot, prompt, sample=True)]
    for _ in range(steps - 1):
        slots = list(prompts)
        for slot, new in zip(slots, engine.decode(slots, [out[s][-1] for s in slots])):
            out[slot] += new
    for slot, prompt in prompts.items():
        assert out[slot][:steps] == hf_greedy(hf, prompt, steps), slot
