"""The compiled decode step (engine/compiled.py): on a tiny random model against eager, and on
SmolLM2 as `strata serve` runs it (compiled is the default). The real model's compiled speed and
compile time are measured by bench/engine_speed.py (`default` vs `default+eager`), never here."""

from __future__ import annotations

import pytest
import torch

from engine.model import ModelConfig, Transformer
from engine.protocol import SamplingParams
from engine.runner import TorchEngine
from engine.weights import DictSource

GREEDY = SamplingParams(temperature=0.0)


def _tiny_engine() -> TorchEngine:
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256,
                      tie_embeddings=True)
    weights = {"embed": torch.randn(256, 64) * 0.5, "norm": torch.ones(64)}
    shapes = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64),
              "down": (64, 128)}
    for i in range(cfg.n_layers):
        weights[f"layers.{i}.attn_norm"] = weights[f"layers.{i}.ffn_norm"] = torch.ones(64)
        for name, shape in shapes.items():
            weights[f"layers.{i}.{name}"] = torch.randn(shape) * 0.2
    model = Transformer.build(cfg, DictSource(weights), dtype=torch.float32, device=torch.device("cpu"))
    model.allocate_cache(num_slots=4, ctx=400)
    return TorchEngine(model, None, eos_token_ids=frozenset())


def _run(engine: TorchEngine) -> list[list[int]]:
    """Four slots with prompts of different lengths; decode steps alternate all four in order
    (sliced when eager) and two scattered ones, and cross the 256-token attention bucket."""
    out = []
    for slot in range(4):
        engine.begin(slot, GREEDY)
        out.append([engine.read(slot, [(7 * slot + i) % 256 for i in range(10 + 60 * slot)], sample=True)])
    for step in range(120):
        active = [0, 1, 2, 3] if step % 3 else [3, 1]
        for slot, token in zip(active, engine.decode(active, [out[s][-1] for s in active])):
            out[slot].append(token)
    return out


def test_compiled_decode_gives_eager_tokens_without_recompiling():
    engine = _tiny_engine()
    eager = _run(engine)
    caches = [t.clone() for block in engine.model.layers for t in (block.k_cache, block.v_cache)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    engine.compile_decode(warm=True)
    # Two graphs, one layer each, that every layer runs: one row, and 2+ rows with dynamic batch
    # and span. Warming wrote to scratch buffers, not to any slot's cache.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert all(torch.equal(a, b) for a, b in
               zip(caches, [t for block in engine.model.layers for t in (block.k_cache, block.v_cache)]))
    with torch._dynamo.config.patch(error_on_recompile=True):  # new batch sizes and spans reuse them
        compiled = _run(engine)
    assert compiled == eager


@pytest.mark.smollm2
def test_default_engine_decodes_compiled_and_a_row_does_not_depend_on_its_neighbours(tmp_path):
    """Compiled and eager greedy tokens can part at near-ties (bf16 rounding inside fused
    kernels; docs/engine.md), so a worker never mixes them: the default compiles at load, and a
    request's tokens must be the same whatever else shares its step."""
    from engine.runner import load_engine

    engine = load_engine(None, num_slots=4, ctx=512, cache_dir=tmp_path)
    assert engine.compiled is not None
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in
               ("What is the capital of France?", "Write a short poem about the sea.", "What is 17 times 23?",
                "Who wrote Romeo and Juliet?")]

    def greedy(group: list[int]) -> list[list[int]]:
        out = {}
        for slot in group:
            engine.begin(slot, GREEDY)
            out[slot] = [engine.read(slot, prompts[slot], sample=True)]
        for _ in range(12):
            for slot, token in zip(group, engine.decode(group, [out[s][-1] for s in group])):
                out[slot].append(token)
        return [out[s] for s in group]

    with torch._dynamo.config.patch(error_on_recompile=True):  # warmed at load: batch 1 and 2+
        together = greedy([0, 1, 2, 3])
        alone = [greedy([slot])[0] for slot in range(4)]
        pair = greedy([3, 1])
    assert together == alone
    assert pair == [alone[3], alone[1]]
