// The prompt product's inner loop: y = x @ W^T in float32 with W unpacked from the file's blocks
// a panel at a time (ops.cpp `prompt_mm` unpacks and splits the work), where float32 is what the
// prompt's linears multiply in (AVX2 alone: no bf16 kernels in oneDNN there).
//
// Why not torch's float32 `F.linear` on unpacked slabs, as before: a prompt token's product must
// not depend on what else its call held (docs/engine.md, "Exact repeats"), and MKL's does at some
// row counts, so a chunk was cut into 64-row pieces, each its own call, and MKL reaches ~85
// GFLOP/s on two cores at 64 rows against ~145 at 256+. Here every output is one chain of fused
// multiply-adds over k = 0, 1, ..., K-1 in that order, whatever the number of rows, their
// position in a tile, the thread that ran them or the panel's width: the same bits for a token in
// any call, so a chunk goes in one call.
//
// The shape is BLIS's: x packed once per call as 6-row micro-panels ([K][6], zero rows padding
// the last), W's rows unpacked 16 at a time for 256 k's and laid out as [kc][16] (16 KB: stays in
// L1 while every x micro-panel passes over it), a 6 x 16 tile of y held in twelve AVX registers
// for the 256 k's, then stored and taken up again for the next 256. build.py compiles this file
// twice (AVX2 + FMA, and the baseline, whose plain loop keeps the same order but not the bits).
#include "layouts.h"  // ENTRY, and the AVX2 intrinsics in that build

namespace {

constexpr int MR = 6, NR = 16;

// c[MR][NR] (a tile of y, ldc apart) = (accumulate ? c : 0) + a[kc][MR] . b[kc][NR], each
// element's products added one k at a time.
inline void tile(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool accumulate) {
#ifdef STRATA_AVX2
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = accumulate ? _mm256_loadu_ps(c + i * ldc + 8 * j) : _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + NR * k), b1 = _mm256_loadu_ps(b + NR * k + 8);
#pragma GCC unroll 6
    for (int i = 0; i < MR; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + MR * k + i);
      acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(c + i * ldc + 8 * j, acc[i][j]);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = accumulate ? c[i * ldc + j] : 0.0f;
      for (int64_t k = 0; k < kc; ++k) s += a[MR * k + i] * b[NR * k + j];
      c[i * ldc + j] = s;
    }
#endif
}

}  // namespace

extern "C" {

// x [M, K] -> ap: ceil(M / 6) micro-panels of [K][6], rows past M zero.
void ENTRY(strata_pack_x)(const float* x, int64_t M, int64_t K, float* ap) {
  for (int64_t p = 0; p < (M + MR - 1) / MR; ++p) {
    float* out = ap + p * K * MR;
    for (int i = 0; i < MR; ++i) {
      const int64_t r = p * MR + i;
      for (int64_t k = 0; k < K; ++k) out[k * MR + i] = r < M ? x[r * K + k] : 0.0f;
    }
  }
}

// w: `rows` (<= 16) unpacked rows of kc floats each (kc apart) -> bp [kc][16], missing rows zero.
void ENTRY(strata_pack_w)(const float* w, int rows, int64_t kc, float* bp) {
#ifdef STRATA_AVX2
  if (rows == NR && kc % 8 == 0) {  // 8 x 8 transposes in registers
    for (int64_t k = 0; k < kc; k += 8)
      for (int h = 0; h < 2; ++h) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(w + (8 * h + j) * kc + k);
        for (int j = 0; j < 8; j += 2) {
          t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
          t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        for (int j = 0; j < 8; j += 4) {
          r[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);
          r[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);
          r[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);
          r[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
        }
        // r[0..3]: columns k+0, k+1, k+2, k+3 of rows 0-3 (low half) and k+4.. (high half); r[4..7] rows 4-7
        for (int j = 0; j < 4; ++j) {
          _mm256_storeu_ps(bp + NR * (k + j) + 8 * h, _mm256_permute2f128_ps(r[j], r[j + 4], 0x20));
          _mm256_storeu_ps(bp + NR * (k + j + 4) + 8 * h, _mm256_permute2f128_ps(r[j], r[j + 4], 0x31));
        }
      }
    return;
  }
#endif
  for (int64_t k = 0; k < kc; ++k)
    for (int j = 0; j < NR; ++j) bp[NR * k + j] = j < rows ? w[j * kc + k] : 0.0f;
}

// y[:, 0:cols] (rows of y ldy apart; cols <= 16) = (k0 > 0 ? y : 0) + x[:, k0:k0+kc] . W^T for
// the panel bp ([kc][16], from strata_pack_w), every row of x (ap from strata_pack_x). tmp: 96
// floats, where a tile with rows or columns past y's edge is computed.
void ENTRY(strata_prompt_panel)(const float* ap, int64_t M, int64_t K, int64_t k0, int64_t kc, const float* bp,
                                float* y, int64_t ldy, int cols, float* tmp) {
  const bool accumulate = k0 > 0;
  for (int64_t p = 0; p < (M + MR - 1) / MR; ++p) {
    const float* a = ap + p * K * MR + k0 * MR;
    float* c = y + p * MR * ldy;
    const int rows = int(M - p * MR < MR ? M - p * MR : MR);
    tile_at_edge<MR, NR>(c, ldy, rows, cols, accumulate, tmp,
                         [&](float* out, int64_t ldc) { tile(a, bp, kc, out, ldc, accumulate); });
  }
}

}  // extern "C"
