"""What one core multiplies per second in a prompt product's inner tile, by the arithmetic it uses:
the ceiling on prompt reading, whatever the unpacking around it.

    .venv/bin/python -m bench.multiply_rate [--rounds 3] [--reps 20000]

Three register tiles over one 256-deep panel in L1 (no memory traffic, no unpacking), each in the
shape its arithmetic fits in sixteen AVX2 registers, one thread:
- float32: `prompt_mm`'s own tile (engine/quants/prompt.cpp), 6 x 16, one fused multiply-add per
  8 products (exact weights times float32 activations);
- int16: activations quantized to 16 bits per 32, weights as int16 codes, 4 x 16, `madd` of
  int16 pairs into int32 per 32 k, then one conversion and one fma by the scales;
- int8: llama.cpp's arithmetic (activations quantized to 8 bits per 32), 4 x 16, `maddubs` of
  unsigned codes and signed activations summed in int16 for 32 k, then `madd` by ones, one
  conversion and one fma.
Prints GMAC/s (10^9 multiply-adds a second) per tile and its ratio to float32, median of the
rounds. The tiles are compiled here with g++ at -O3 for x86-64-v3 (needs an AVX2 machine and
g++); not asserted (the cores are shared: compare numbers of one run)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
constexpr int NR = 16, KC = 256, PANELS = 16;

__attribute__((noinline)) void tile_f32(const float* a, const float* b, float* c) {
  __m256 acc[6][2];
  for (int i = 0; i < 6; ++i) for (int j = 0; j < 2; ++j) acc[i][j] = _mm256_loadu_ps(c + i * NR + 8 * j);
  for (int k = 0; k < KC; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + NR * k), b1 = _mm256_loadu_ps(b + NR * k + 8);
#pragma GCC unroll 6
    for (int i = 0; i < 6; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + 6 * k + i);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < 6; ++i) for (int j = 0; j < 2; ++j) _mm256_storeu_ps(c + i * NR + 8 * j, acc[i][j]);
}

inline void flush(__m256i s0, __m256i s1, const float* sw, float d, float* c) {
  const __m256 dd = _mm256_set1_ps(d);
  _mm256_storeu_ps(c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(_mm256_loadu_ps(sw), dd), _mm256_loadu_ps(c)));
  _mm256_storeu_ps(c + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(_mm256_loadu_ps(sw + 8), dd), _mm256_loadu_ps(c + 8)));
}

// a: int16 [KC/2][4][2], b: int16 [KC/2][16][2]
__attribute__((noinline)) void tile_i16(const int16_t* a, const int16_t* b, const float* sw, const float* dx, float* c) {
  for (int g = 0; g < KC / 32; ++g) {
    __m256i acc[4][2];
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    for (int p = 16 * g; p < 16 * g + 16; ++p) {
      const __m256i b0 = _mm256_loadu_si256((const __m256i*)(b + 32 * p)), b1 = _mm256_loadu_si256((const __m256i*)(b + 32 * p + 16));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i ai = _mm256_castps_si256(_mm256_broadcast_ss((const float*)(a + 8 * p + 2 * i)));
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(ai, b0));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(ai, b1));
      }
    }
    for (int i = 0; i < 4; ++i) flush(acc[i][0], acc[i][1], sw + 16 * g, dx[4 * g + i], c + i * NR);
  }
}

// a: int8 [KC/4][4][4], b: uint8 [KC/4][16][4]
__attribute__((noinline)) void tile_i8(const int8_t* a, const uint8_t* b, const float* sw, const float* dx, float* c) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int g = 0; g < KC / 32; ++g) {
    __m256i acc[4][2];
    for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 8 * g; q < 8 * g + 8; ++q) {
      const __m256i b0 = _mm256_loadu_si256((const __m256i*)(b + 64 * q)), b1 = _mm256_loadu_si256((const __m256i*)(b + 64 * q + 32));
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const __m256i ai = _mm256_castps_si256(_mm256_broadcast_ss((const float*)(a + 16 * q + 4 * i)));
        acc[i][0] = _mm256_add_epi16(acc[i][0], _mm256_maddubs_epi16(b0, ai));
        acc[i][1] = _mm256_add_epi16(acc[i][1], _mm256_maddubs_epi16(b1, ai));
      }
    }
    for (int i = 0; i < 4; ++i)
      flush(_mm256_madd_epi16(acc[i][0], ones), _mm256_madd_epi16(acc[i][1], ones), sw + 16 * g, dx[4 * g + i], c + i * NR);
  }
}

int main(int argc, char** argv) {
  const long reps = std::atol(argv[1]);
  std::vector<float> af(PANELS * KC * 6, 0.5f), bf(KC * NR, 0.25f), c(PANELS * 6 * NR, 0.0f), sw(KC / 32 * NR, 1e-3f),
      dx(PANELS * KC / 32 * 4, 1e-3f);
  std::vector<int16_t> a16(PANELS * KC * 4, 3), b16(KC * NR, 5);
  std::vector<int8_t> a8(PANELS * KC * 4, 3);
  std::vector<uint8_t> b8(KC * NR, 5);
  auto rate = [&](int rows, auto&& run) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long n = 0; n < reps; ++n) for (int p = 0; p < PANELS; ++p) run(p);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return double(reps) * PANELS * KC * rows * NR / s / 1e9;
  };
  const double f32 = rate(6, [&](int p) { tile_f32(af.data() + p * KC * 6, bf.data(), c.data() + p * 6 * NR); });
  const double i16 = rate(4, [&](int p) { tile_i16(a16.data() + p * KC * 4, b16.data(), sw.data(), dx.data() + p * KC / 8, c.data() + p * 6 * NR); });
  const double i8 = rate(4, [&](int p) { tile_i8(a8.data() + p * KC * 4, b8.data(), sw.data(), dx.data() + p * KC / 8, c.data() + p * 6 * NR); });
  std::printf("%f %f %f %f\n", f32, i16, i8, c[0]);
}
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "tiles.cpp", Path(tmp) / "tiles"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O3", "-march=x86-64-v3", str(src), "-o", str(exe)], check=True)
        runs = [[float(v) for v in subprocess.run([str(exe), str(args.reps)], check=True, capture_output=True,
                                                  text=True).stdout.split()[:3]] for _ in range(args.rounds)]
    names = ("float32 fma, 6 x 16", "int16 madd, 4 x 16", "int8 maddubs, 4 x 16")
    medians = [statistics.median(run[i] for run in runs) for i in range(3)]
    for name, rate in zip(names, medians):
        print(f"{name:24s} {rate:6.1f} GMAC/s  {rate / medians[0]:.2f}x float32")


if __name__ == "__main__":
    main()
