"""engine/attend.cpp's per-task kernel (`attend_one`) against another revision's, in one process.

    .venv/bin/python -m bench.attend_kernel --baseline HEAD~1 [--spans 1500 4000] [--rounds 5]

Two versions of the same torch op cannot be loaded into one process, and this VM's speed drifts
by tens of percent between processes, so this takes the kernel itself (everything attend.cpp
holds before its torch wrapper) from the working tree and from `--baseline` (`git show`), wraps
each in a namespace of its own, and compiles both into one program with g++ (the flags build.py
gives attend.cpp, no torch). The program times one row's decode attention on SmolLM2-135M's layer
shape (9 query heads over 3 KV heads of 64, float32 pool) over `span` positions, the three KV
heads one after the other on one thread, the pool of 8 layers (~200 MB, beyond the caches)
taken in turn, the two versions alternating within each round; it checks that both give the
same output bits. Prints us a call (all three heads) per version and their ratio, per round.
Not asserted (the cores are shared: compare numbers of one run)."""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

from engine.quants.build import ATTEND_FLAGS, COMMON

MAIN = r"""
template <typename F> double micros(F f, int reps) {
  const auto t = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) f();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count() / reps;
}

int main(int argc, char** argv) {
  const int64_t KV = 3, G = 3, D = 64, N = 16384, LAYERS = 8, L = std::atol(argv[1]), rounds = std::atol(argv[2]);
  std::vector<std::vector<float>> kp(LAYERS, std::vector<float>(KV * N * D)), vp(LAYERS, std::vector<float>(KV * N * D));
  std::vector<float> q(KV * G * D), out_base(KV * G * D), out_tree(KV * G * D);
  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  for (auto& p : kp) for (auto& x : p) x = normal(gen);
  for (auto& p : vp) for (auto& x : p) x = normal(gen);
  for (auto& x : q) x = normal(gen);
  std::vector<int64_t> at(L);
  for (int64_t l = 0; l < L; ++l) at[l] = l;
  std::vector<char> mask(L, 1);
  const bool* m = reinterpret_cast<const bool*>(mask.data());
  auto layer = [&](auto fn, float* out) {
    return micros([&] {
      for (int64_t y = 0; y < LAYERS; ++y)
        for (int64_t h = 0; h < KV; ++h) fn(y, h, out);
    }, 10) / LAYERS;
  };
  auto base = [&](int64_t y, int64_t h, float* out) {
    base_kernel::Shapes s{1, 1, KV * G, KV, G, D, L, N, D * 4};
    base_kernel::attend_one(s, 0, h, base_kernel::Entry::F32, 0.125f, q.data(), (const uint8_t*)kp[y].data(),
                            (const uint8_t*)vp[y].data(), at.data(), m, out);
  };
  auto tree = [&](int64_t y, int64_t h, float* out) {
    tree_kernel::Shapes s{1, 1, KV * G, KV, G, D, L, N, D * 4};
    tree_kernel::attend_one(s, 0, h, tree_kernel::Entry::F32, 0.125f, q.data(), (const uint8_t*)kp[y].data(),
                            (const uint8_t*)vp[y].data(), at.data(), m, out);
  };
  for (int64_t r = 0; r < rounds; ++r) {
    const double b = layer(base, out_base.data()), t = layer(tree, out_tree.data());
    std::printf("%ld %.1f %.1f %d\n", L, b, t, std::memcmp(out_base.data(), out_tree.data(), 4 * out_base.size()) == 0);
  }
}
"""

HEADERS = ["algorithm", "chrono", "cmath", "cstdint", "cstdio", "cstdlib", "cstring", "limits", "memory", "random",
           "vector"]


def kernel(source: str) -> str:
    """What attend.cpp holds between its anonymous namespace's start and the torch wrapper."""
    start = source.index("namespace {") + len("namespace {")
    end = source.find("\n// q [B, T, H, D]", start)  # the wrapper's own comment
    return source[start:end if end >= 0 else source.index("at::Tensor decode(", start)]


def program(base: str, tree: str) -> str:
    prelude = "".join(f"#include <{h}>\n" for h in HEADERS)
    macros = ('#define CLONES __attribute__((target_clones("avx2", "default")))\n'  # attend.cpp's, defined
              "#define INLINE inline __attribute__((always_inline))\n")  # before its namespace
    return prelude + macros + "".join(f"namespace {name} {{\n{kernel(src)}\n}}\n"
                                      for name, src in (("base_kernel", base), ("tree_kernel", tree))) + MAIN


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="git ref whose engine/attend.cpp is the baseline")
    parser.add_argument("--spans", type=int, nargs="+", default=[1500, 4000])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    base = subprocess.run(["git", "show", f"{args.baseline}:engine/attend.cpp"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    tree = (root / "engine" / "attend.cpp").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "attend_kernel.cpp", Path(tmp) / "attend_kernel"
        src.write_text(program(base, tree))
        subprocess.run(["g++", *COMMON, *ATTEND_FLAGS, str(src), "-o", str(exe)], check=True)
        print(f"{'span':>6} {'baseline us':>12} {'tree us':>9} {'ratio':>6}  same bits")
        for span in args.spans:
            out = subprocess.run([str(exe), str(span), str(args.rounds)], check=True, capture_output=True, text=True)
            for line in out.stdout.split("\n"):
                if line:
                    L, b, t, same = line.split()
                    print(f"{L:>6} {float(b):12.0f} {float(t):9.0f} {float(b) / float(t):5.2f}x  {same == '1'}")


if __name__ == "__main__":
    main()
