"""One layer's decode attention over the paged KV pool, three ways, on SmolLM2-135M's layer shape
(9 query heads over 3 KV heads of 64, float32 pool) for B rows whose positions lie in scattered
64-position blocks:
- `gather` eager: each row's positions gathered (`index_select`, engine/layers.py), then
  `attend_plain` (matmul, softmax, matmul);
- `gather` compiled: the same under torch.compile (inductor makes its own gather, as the
  compiled step and the packages did);
- `in place`: strata_attend::decode (engine/attend.cpp), reading the pool where it lies.
All three give the same output within 1e-5 (asserted); CPU ms per call, median of --calls,
the three taken in turns.

    .venv/bin/python -m bench.decode_attention [--batches 1 4 8] [--spans 256 1024] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.layers import attend_plain, gather_index
from engine.quants.build import load

KV, G, D, BS = 3, 3, 64, 64


def gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, read_at: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    rows, span = read_at.shape
    at = gather_index(read_at, KV, k.shape[1])
    keys = k.view(-1, D).index_select(0, at).view(rows, KV, span, D)
    values = v.view(-1, D).index_select(0, at).view(rows, KV, span, D)
    return attend_plain(q.transpose(1, 2), keys, values, mask.view(rows, 1, 1, 1, span))


def in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, read_at: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.ops.strata_attend.decode(q, k, v, read_at, mask, D**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--spans", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    assert load("strata_attend") is None, load("strata_attend")
    compiled = torch.compile(gathered, dynamic=True)
    forms = {"gather eager": gathered, "gather compiled": compiled, "in place": in_place}
    print(f"threads {args.threads}; CPU ms per call, median of {args.calls}")
    print("| B | span | " + " | ".join(forms) + " | in place / compiled |")
    print("|---|---|" + "---|" * (len(forms) + 1))
    for span in args.spans:
        for rows in args.batches:
            blocks = 8 * 2048 // BS
            pool_len = blocks * BS
            k, v = torch.randn(KV, pool_len, D), torch.randn(KV, pool_len, D)
            order = torch.randperm(blocks)
            need = -(-span // BS)
            read_at = torch.stack([(order[b * need:(b + 1) * need].view(-1, 1) * BS + torch.arange(BS)).reshape(-1)[:span]
                                   for b in range(rows)])
            q = torch.randn(rows, 1, KV * G, D)
            mask = torch.ones(rows, 1, span, dtype=torch.bool)
            want = gathered(q, k, v, read_at, mask)
            for form in forms.values():
                torch.testing.assert_close(form(q, k, v, read_at, mask), want, rtol=1e-5, atol=1e-5)
            times: dict[str, list[float]] = {name: [] for name in forms}
            for _ in range(args.calls):
                for name, form in forms.items():
                    t = time.process_time()
                    form(q, k, v, read_at, mask)
                    times[name].append((time.process_time() - t) * 1e3)
            ms = {name: statistics.median(t) for name, t in times.items()}
            print(f"| {rows} | {span} | " + " | ".join(f"{m:.3f}" for m in ms.values())
                  + f" | {ms['in place'] / ms['gather compiled']:.2f}x |")


if __name__ == "__main__":
    main()
