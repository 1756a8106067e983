"""A tiny random dense model as a TorchEngine, and the greedy runs the step tests compare across
back-ends (eager, per-layer graphs, AOT packages, CUDA graphs)."""

from __future__ import annotations

import torch

from engine.model import ModelConfig, Transformer
from engine.protocol import SamplingParams
from engine.runner import TorchEngine
from engine.weights import DictSource

GREEDY = SamplingParams(temperature=0.0)


TINY = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=256,
                   tie_embeddings=True)


def tiny_weights(scale: float = 0.2) -> DictSource:
    """TINY's random weights (seed 0): embeddings at 0.5, every linear at `scale`, unit norms."""
    torch.manual_seed(0)
    weights = {"embed": torch.randn(256, 64) * 0.5, "norm": torch.ones(64)}
    shapes = {"q": (64, 64), "k": (32, 64), "v": (32, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64),
              "down": (64, 128)}
    for i in range(TINY.n_layers):
        weights[f"layers.{i}.attn_norm"] = weights[f"layers.{i}.ffn_norm"] = torch.ones(64)
        for name, shape in shapes.items():
            weights[f"layers.{i}.{name}"] = torch.randn(shape) * scale
    return DictSource(weights)


def tiny_engine(num_slots: int = 4, device: str = "cpu", ctx: int = 400) -> TorchEngine:
    model = Transformer.build(TINY, tiny_weights(), dtype=torch.float32, device=torch.device(device))
    model.allocate_cache(num_slots=num_slots, ctx=ctx)
    return TorchEngine(model, None, eos_token_ids=frozenset())


def run_four_slots(engine: TorchEngine) -> list[list[int]]:
    """Four slots with prompts of different lengths; decode steps alternate all four in order
    (sliced when eager) and two scattered ones, and cross the 256-token attention bucket."""
    out = []
    for slot in range(4):
        engine.begin(slot, GREEDY)
        out.append([engine.read(slot, [(7 * slot + i) % 256 for i in range(10 + 60 * slot)], sample=True)])
    for step in range(120):
        active = [0, 1, 2, 3] if step % 3 else [3, 1]
        for slot, new in zip(active, engine.decode(active, [out[s][-1] for s in active])):
            out[slot] += new
    return out


def packaged_run(engine: TorchEngine) -> list[list[int]]:
    """Slot 2 alone (a prompt, one-row steps across the 256-token attention bucket), then slots
    0, 2 and 3 together, then 3 and 1."""
    out = {}
    for slot, length in ((2, 200), (0, 30), (3, 90), (1, 5)):
        engine.begin(slot, GREEDY)
        out[slot] = [engine.read(slot, [(5 * i + slot) % 256 for i in range(length)], sample=True)]
    for group, steps in (([2], 70), ([0, 2, 3], 40), ([3, 1], 20)):
        for _ in range(steps):
            for slot, new in zip(group, engine.decode(group, [out[s][-1] for s in group])):
                out[slot] += new
    return [out[s] for s in range(4)]
