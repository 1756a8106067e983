"""Decode and prompt speed of the newer families on random-weight models of a real checkpoint's
layer shapes, with fewer layers (and experts) so they fit this shared machine:

    .venv/bin/python -m bench.models_speed [--family qwen3moe gemma3 dense qwen3next] [--steps 8]

- qwen3moe: Qwen3-30B-A3B's layer (dim 2048, 32 heads / 4 kv of 128, 8 of the experts of
  768 each per token), 32 experts instead of 128, 4 layers instead of 48, vocabulary 32 000.
- gemma3: Gemma-3-1B's layer (dim 1152, 4 heads / 1 kv of 256, FFN 6912, window 512, every 6th
  layer global), 6 layers instead of 26, vocabulary 32 000.
- dense: a Qwen3 layer of the MoE's active size (FFN 8 x 768 = 6144), 4 layers: what the MoE's
  routing and gathering cost beside a dense FFN of the same arithmetic.
- qwen3next: Qwen3-Next-80B-A3B's layers (dim 2048; Gated DeltaNet of 16 key / 32 value heads of
  128, kernel 4; gated attention of 16 heads / 2 kv of 256, RoPE on 64 dims; 10 of the experts
  of 512 each per token and a shared expert of 512), 32 experts instead of 512, 4 layers (3
  DeltaNet, 1 attention, its 3:1 pattern) instead of 48, vocabulary 32 000.

Model level (no tokenizer, no worker), eager, CPU bf16 as `strata serve` builds a Q8_0 file
(bf16 oneDNN-prepacked linears where the CPU has them, bf16 experts, float32 routing, attention
and recurrent state): decode tok/s at 1 and 4 rows over ~200 cached tokens, prompt tok/s of one
512-token chunk (bench/step_timing.py's loop, shared with bench/quant_speed.py). Random weights:
speed only. Not asserted; the cores are shared, so compare numbers measured in one run.
llama-server beside it on the same shapes needs a GGUF of them and /work/llbuild's build (not
finished this session): not done here."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.step_timing import measure
from engine.deltanet import DeltaNetShape, delta_rule_chunked, delta_rule_steps
from engine.model import ModelConfig, Transformer
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
    if family == "qwen3next":
        return ModelConfig(dim=2048, n_layers=4, n_heads=16, n_kv_heads=2, head_dim=256, hidden_dim=512,
                           vocab_size=32000, qk_norm=True, n_experts_used=10, tie_embeddings=False, rope_theta=1e7,
                           linear_layers=(True, True, True, False), rotary_dim=64, attn_gate=True,
                           linear=DeltaNetShape(n_k_heads=16, n_v_heads=32, k_dim=128, v_dim=128, kernel=4)), 32, 512
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
        w |= {p + "attn_norm": torch.ones(cfg.dim), p + "ffn_norm": torch.ones(cfg.dim)}
        if cfg.is_linear(i):
            s = cfg.linear
            assert s is not None
            w |= {p + "lin_qkv": rand(s.conv_dim, cfg.dim), p + "lin_z": rand(s.value_size, cfg.dim),
                  p + "lin_b": rand(s.n_v_heads, cfg.dim), p + "lin_a": rand(s.n_v_heads, cfg.dim),
                  p + "lin_conv": rand(s.conv_dim, s.kernel).float(), p + "lin_dt_bias": torch.ones(s.n_v_heads),
                  p + "lin_a_neg": -torch.ones(s.n_v_heads), p + "lin_norm": torch.ones(s.v_dim),
                  p + "lin_out": rand(cfg.dim, s.value_size)}
        else:
            w |= {p + "q": rand(cfg.q_size, cfg.dim), p + "k": rand(cfg.kv_size, cfg.dim),
                  p + "v": rand(cfg.kv_size, cfg.dim), p + "o": rand(cfg.dim, cfg.q_size)}
            if cfg.attn_gate:
                w[p + "q_gate"] = rand(cfg.q_size, cfg.dim)
        if cfg.qk_norm:
            w |= {p + "q_norm": torch.ones(cfg.head_dim), p + "k_norm": torch.ones(cfg.head_dim)}
        if cfg.embed_scale != 1.0:  # Gemma's post norms
            w |= {p + "post_attn_norm": torch.ones(cfg.dim), p + "post_ffn_norm": torch.ones(cfg.dim)}
        if experts:
            w |= {p + "router": rand(experts, cfg.dim).float(), p + "experts_gate": rand(experts, expert_ffn, cfg.dim),
                  p + "experts_up": rand(experts, expert_ffn, cfg.dim), p + "experts_down": rand(experts, cfg.dim, expert_ffn)}
            if cfg.linear is not None:  # Qwen3-Next's shared expert, as large as one routed expert
                w |= {p + "shared_gate": rand(expert_ffn, cfg.dim), p + "shared_up": rand(expert_ffn, cfg.dim),
                      p + "shared_down": rand(cfg.dim, expert_ffn), p + "shared_router": rand(1, cfg.dim).float()}
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
    decode, read = measure(model, batches, steps, CONTEXT, PROMPT)
    for batch, step in decode.items():
        print(f"  decode B={batch}: {step.per_second(batch):.1f} tok/s ({step.wall_s * 1000:.0f} ms a step, "
              f"median of {steps})")
    print(f"  prompt: {read.per_second(PROMPT):.1f} tok/s (one {PROMPT}-token chunk)")


def rule(rounds: int) -> None:
    """The gated delta rule alone on the qwen3next shape's 32 value heads over one 512-token read:
    its chunkwise form (what a prompt read runs) against the token loop (what it ran before),
    alternating, CPU time (so other processes on the cores count less)."""
    shape = config("qwen3next")[0].linear
    assert shape is not None
    gen = torch.Generator().manual_seed(0)
    heads, dk, dv = shape.n_v_heads, shape.k_dim, shape.v_dim
    q = F.normalize(torch.randn(1, PROMPT, heads, dk, generator=gen), dim=-1) * dk ** -0.5
    k = F.normalize(torch.randn(1, PROMPT, heads, dk, generator=gen), dim=-1)
    v = torch.randn(1, PROMPT, heads, dv, generator=gen)
    beta, g = torch.rand(1, PROMPT, heads, generator=gen), -0.1 * torch.rand(1, PROMPT, heads, generator=gen)
    state = torch.zeros(1, heads, dk, dv)
    forms = {"chunked": delta_rule_chunked, "loop": delta_rule_steps}
    spent: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds + 1):  # the first round warms both up and is not counted
        for name, form in forms.items():
            started = time.process_time()
            form(q, k, v, beta, g, state)
            spent[name].append(time.process_time() - started)
    chunked, loop = (statistics.median(spent[n][1:]) for n in forms)
    print(f"delta rule, {PROMPT} tokens x {heads} heads: chunked {chunked * 1000:.0f} ms, loop {loop * 1000:.0f} ms "
          f"CPU (median of {rounds}): {loop / chunked:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="*", default=["qwen3moe", "dense", "gemma3"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rule", type=int, default=0, metavar="ROUNDS",
                        help="also time the delta rule alone, chunked vs token loop, this many rounds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rule:
        rule(args.rule)
    for family in args.family:
        run(family, args.batches, args.steps)


if __name__ == "__main__":
    main()
