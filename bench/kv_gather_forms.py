"""Two ways a decode step could gather its rows' K from the paged pool, eager and under
torch.compile: by position (what engine/layers.py does: one index per row, head and position)
and by block (one index per row, head and 64-position block, then the span sliced), on a pool
of SmolLM2-135M's layer shape (3 KV heads of 64) for 8 slots of 2 048 positions in scattered
blocks, followed by the scores' matmul so the compiled graph may fuse the gather into it. Both
give the same scores (asserted); median of 30 calls each.

    .venv/bin/python -m bench.kv_gather_forms [--spans 256 1024 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

KV, HD, BS, SLOTS, CTX = 3, 64, 64, 8, 2048


def by_position(pool: torch.Tensor, read_at: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    heads = torch.arange(KV).view(1, -1, 1) * pool.shape[1]
    at = (read_at.unsqueeze(1) + heads).reshape(-1)
    k = pool.view(-1, HD).index_select(0, at).view(SLOTS, KV, -1, HD)
    return torch.matmul(q, k.transpose(-1, -2))


def by_block(pool: torch.Tensor, read_at: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    span = read_at.shape[1]
    blocks = read_at[:, ::BS] // BS  # a row's positions lie in its blocks in order: read_at[b, j*BS] = block*BS
    heads = torch.arange(KV).view(1, -1, 1) * (pool.shape[1] // BS)
    at = (blocks.unsqueeze(1) + heads).reshape(-1)
    k = pool.view(-1, BS * HD).index_select(0, at).view(SLOTS, KV, -1, HD)[:, :, :span]
    return torch.matmul(q, k.transpose(-1, -2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pool = torch.randn(KV, SLOTS * CTX + BS, HD)
    tables = torch.randperm(SLOTS * CTX // BS).view(SLOTS, CTX // BS)
    q = torch.randn(SLOTS, KV, 3, HD)  # 9 query heads in 3 groups
    for span in args.spans:
        pos = torch.arange(span)
        read_at = tables[:, pos // BS] * BS + pos % BS
        assert torch.equal(by_position(pool, read_at, q), by_block(pool, read_at, q))
        for name, fn in (("position", by_position), ("block", by_block)):
            for mode in ("eager", "compiled"):
                f = torch.compile(fn, dynamic=False) if mode == "compiled" else fn
                with torch.inference_mode():
                    f(pool, read_at, q)
                    times = []
                    for _ in range(30):
                        started = time.perf_counter()
                        f(pool, read_at, q)
                        times.append(time.perf_counter() - started)
                print(f"span {span:5d}  by {name:8s} {mode:8s} {sorted(times)[15] * 1e6:7.0f} us", flush=True)


if __name__ == "__main__":
    main()
