"""Decode and prompt speed of the newer families on random-weight models of a real checkpoint's
layer shapes, with fewer layers (and experts) so they fit this shared machine:

    .venv/bin/python -m bench.models_speed [--family qwen3moe gemma3 dense] [--steps 8]

- qwen3moe: Qwen3-30B-A3B's layer (dim 2048, 32 heads / 4 kv of 128, 8 of the experts of
  768 each per token), 32 experts instead of 128, 4 layers instead of 48, vocabulary 32 000.
- gemma3: Gemma-3-1B's layer (dim 1152, 4 heads / 1 kv of 256, FFN 6912, window 512, every 6th
  layer global), 6 layers instead of 26, vocabulary 32 000.
- dense: a Qwen3 layer of the MoE's active size (FFN 8 x 768 = 6144), 4 layers: what the MoE's
  routing and gathering cost beside a dense FFN of the same arithmetic.

Model level (no tokenizer, no worker), eager, CPU bf16 as `strata serve` builds a Q8_0 file
(bf16 oneDNN-prepacked linears, bf16 experts, float32 routing and attention): decode tok/s at
1 and 4 rows over ~200 cached tokens, prompt tok/s of one 512-token chunk. Random weights: speed
only. Not asserted; the cores are shared, so compare numbers measured in one run."""

from __future__ import annotations

import argparse
import time

import torch

from engine.model import CacheIndex, ModelConfig, Transformer
from engine.weights import DictSource

CONTEXT, PROMPT = 200, 512


def config(family: str) -> tuple[ModelConfig, int, int]:
    """-> (config, experts, expert FFN size)."""
    if family == "qwen3moe":
        return ModelConfig(dim=2048, n_layers=4, n_heads=32, n_kv_heads=4, head_dim=128, hidden_dim=6144,
                           vocab_size=32000, qk_norm=True, n_experts_used=8, tie_embeddings=False), 32, 768
    if family == "dense":
        return ModelConfig(dim=2048, n_layers=4, n_heads=32, n_kv_heads=4, head_dim=128, hidden_dim=6144,
                           vocab_size=32000, qk_norm=True, tie_embeddings=False), 0, 0
    if family == "gemma3":
        return ModelConfig(dim=1152, n_layers=6, n_heads=4, n_kv_heads=1, head_dim=256, hidden_dim=6912,
                           vocab_size=32000, qk_norm=True, tie_embeddings=True, sliding_window=512,
                           sliding_layers=tuple((i + 1) % 6 != 0 for i in range(6)), rope_theta=1e6,
                           rope_local_theta=1e4, attn_scale=256 ** -0.5, embed_scale=1152 ** 0.5,
                           activation="gelu_tanh"), 0, 0
    raise ValueError(family)


def random_weights(cfg: ModelConfig, experts: int, expert_ffn: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.bfloat16) * shape[-1] ** -0.5

    w = {"embed": rand(cfg.vocab_size, cfg.dim), "norm": torch.ones(cfg.dim)}
    if not cfg.tie_embeddings:
        w["output"] = rand(cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        w |= {p + "attn_norm": torch.ones(cfg.dim), p + "ffn_norm": torch.ones(cfg.dim),
              p + "q": rand(cfg.q_size, cfg.dim), p + "k": rand(cfg.kv_size, cfg.dim), p + "v": rand(cfg.kv_size, cfg.dim),
              p + "o": rand(cfg.dim, cfg.q_size)}
        if cfg.qk_norm:
            w |= {p + "q_norm": torch.ones(cfg.head_dim), p + "k_norm": torch.ones(cfg.head_dim)}
        if cfg.embed_scale != 1.0:  # Gemma's post norms
            w |= {p + "post_attn_norm": torch.ones(cfg.dim), p + "post_ffn_norm": torch.ones(cfg.dim)}
        if experts:
            w |= {p + "router": rand(experts, cfg.dim).float(), p + "experts_gate": rand(experts, expert_ffn, cfg.dim),
                  p + "experts_up": rand(experts, expert_ffn, cfg.dim), p + "experts_down": rand(experts, cfg.dim, expert_ffn)}
        else:
            w |= {p + "gate": rand(cfg.hidden_dim, cfg.dim), p + "up": rand(cfg.hidden_dim, cfg.dim),
                  p + "down": rand(cfg.dim, cfg.hidden_dim)}
    return w


def run(family: str, batches: list[int], steps: int) -> None:
    cfg, experts, expert_ffn = config(family)
    started = time.perf_counter()
    model = Transformer.build(cfg, DictSource(random_weights(cfg, experts, expert_ffn)), dtype=torch.bfloat16,
                              device=torch.device("cpu"))
    slots = max(batches)
    model.allocate_cache(slots, CONTEXT + PROMPT + steps + 8)
    print(f"{family}: forms {model.forms}, built in {time.perf_counter() - started:.1f}s")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for s in range(slots):  # ~200 tokens of context in every slot
            ids = torch.randint(0, cfg.vocab_size, (1, CONTEXT), generator=gen)
            model(ids, CacheIndex.for_slots([s], torch.arange(CONTEXT).unsqueeze(0), CONTEXT))
        for batch in batches:
            rows = list(range(batch))
            tokens = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
            times = []
            for step in range(steps + 1):
                pos = torch.full((batch, 1), CONTEXT + step)
                started = time.perf_counter()
                h = model(tokens, CacheIndex.for_slots(rows, pos, 256 * ((CONTEXT + step) // 256 + 1)))
                tokens = model.logits(h).argmax(-1, keepdim=True)
                times.append(time.perf_counter() - started)
            per_step = sorted(times[1:])[len(times[1:]) // 2]
            print(f"  decode B={batch}: {batch / per_step:.1f} tok/s ({per_step * 1000:.0f} ms a step, median of {steps})")
        ids = torch.randint(0, cfg.vocab_size, (1, PROMPT), generator=gen)
        start = CONTEXT + steps + 1
        started = time.perf_counter()
        model(ids, CacheIndex.for_slots([0], torch.arange(start, start + PROMPT).unsqueeze(0), start + PROMPT))
        print(f"  prompt: {PROMPT / (time.perf_counter() - started):.1f} tok/s (one {PROMPT}-token chunk)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=["qwen3moe", "dense", "gemma3"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for family in args.family:
        run(family, args.batches, args.steps)


if __name__ == "__main__":
    main()
