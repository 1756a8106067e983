// The prompts of the type that takes 16-bit activations (layouts.h `takes_x16`: Q4_1) where the
// CPU has AVX-512 BF16 but no AMX (AMD Zen 4 and 5): y = x @ W^T with x rounded to bf16 (as
// oneDNN's bf16 products round it) and W's codes as exact bf16 integers, centred: c = u - 8 for
// its nibbles u, multiplied by `vdpbf16ps` (each product of two bf16 exact in float32), summed per
// block of 32 weights in float32, then
//   y += sum * d   and   y += (m + 8 d) * xs   (xs: each block's sum of x in float32)
// the block's scale and minimum applied once per sum as the integer tiles do. x's rounding error
// then meets the centred codes alone (with Q4_1's uncentred nibbles, 0..15, it met codes of mean
// 7.5: the default model's mean KL to float32 was several times larger, test_precision). What it
// replaces: a bf16 copy of those matrices
// (oneDNN's prepacked weights, rounded d * q: 3.4 GB for a 1.7B model beside its 1 GB of blocks),
// or 16-bit integer activations (prompt_int8.cpp's wide tile: twice the `vpdpbusd` of int8, the
// rate per weight of `vdpbf16ps` here, with more float work per block).
//
// A panel of 16 output columns by 256 weights becomes [128][16][2] bf16 words (8 KB: in L1) once,
// straight from the repacked rows (or through prompt_int8.cpp's codes for the file's blocks), and
// every 8-row micro-panel of x passes over it: an 8 x 16 tile of y in eight zmm registers, eight
// more for the block's sums. Each output is one fixed chain of float operations over k in order,
// so a row's result is the same bits whatever the other rows of the call, its place in a tile or
// the thread that ran it, and a chunk goes in one call.
// Only this build exists (build.py); ops.cpp calls it only where bf16_prompt().
#include "layouts.h"

#include <bit>

namespace {

constexpr int MR = 8, NR = 16, KC = 256;  // KC: ops.cpp's panels' depth

// The tables below are constants, made by the compiler: no code of this AVX-512 build runs when
// the library loads on a CPU without it.
// The 16 nibbles' centred values u - 8 as bf16 (small integers: exact), 32 words for `vpermw`.
struct Centred {
  alignas(64) uint16_t bf16[32] = {};
  constexpr Centred() {
    for (int u = 0; u < 32; ++u) bf16[u] = uint16_t(std::bit_cast<uint32_t>(float(u - 8)) >> 16);
  }
};
constexpr Centred CENTRED;

// Which word of two groups' quads (A's 32 words, then B's) lands where in a pair's row: word 2 col
// + e of the pair c (a quad's weights 2 c, 2 c + 1) from word 4 (col % 8) + 2 c + e, of B past 8.
struct Pick {
  alignas(64) uint16_t words[2][32] = {};
  constexpr Pick() {
    for (int c = 0; c < 2; ++c)
      for (int col = 0; col < 16; ++col)
        for (int e = 0; e < 2; ++e) words[c][2 * col + e] = uint16_t((col < 8 ? 0 : 32) + 4 * (col % 8) + 2 * c + e);
  }
};
constexpr Pick PICK;

inline const int32_t* pair_at(const uint16_t* row, int64_t g, int p) {  // weights 32 g + 2 p and the next
  return reinterpret_cast<const int32_t*>(row + 32 * g + 2 * p);
}

inline __m256 halves(const uint8_t* p) {  // eight IEEE halves -> floats, exactly
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// c[MR][NR] (ldc apart) = (accumulate ? c : 0) + the tile's share of k in [0, kc): x rows (bf16,
// KC apart: strata_pack_x_bf16) and xs rows (K / 32 apart) from the panel's first weight; w the
// panel's [kc/2][16][2] words, s [kc/32][16] scales, m [kc/32][16] minimums.
inline void tile(const uint16_t* x, int64_t K, const float* xs, const uint16_t* w, const float* s, const float* m,
                 int64_t kc, float* c, int64_t ldc, bool accumulate) {
  const int64_t C = K / 32;
  __m512 y[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) y[r] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
  for (int64_t g = 0; g < kc / 32; ++g) {
    // the block's sums: each row's first pair into a register zeroed by the zero idiom (no move
    // issued), the other pairs added with x's pair broadcast from memory (one instruction)
    __m512 t[MR];
    __m512bh wv = (__m512bh)_mm512_loadu_si512(w + 32 * 16 * g);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      asm("vpxord %0, %0, %0\n\tvdpbf16ps %2%{1to16%}, %1, %0"
          : "=&v"(t[r])
          : "v"(wv), "m"(*pair_at(x + r * KC, g, 0)));
#pragma GCC unroll 15
    for (int p = 1; p < 16; ++p) {
      wv = (__m512bh)_mm512_loadu_si512(w + 32 * (16 * g + p));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(t[r]) : "v"(wv), "m"(*pair_at(x + r * KC, g, p)));
    }
    const __m512 d = _mm512_loadu_ps(s + NR * g);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) y[r] = _mm512_fmadd_ps(t[r], d, y[r]);
    const __m512 mv = _mm512_loadu_ps(m + NR * g);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) y[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * C + g]), y[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(c + r * ldc, y[r]);
}

}  // namespace

extern "C" {

// x [M, K] float32 -> bf16 (round to nearest even, as torch and oneDNN round) in chunks of KC
// weights: chunk j's rows [Mp][KC] at out + j * Mp * KC (rows past M and weights past K zero).
// A tile's eight rows are then 512 bytes apart, not K * 2: rows 4 KB apart fell in one set of
// the L1 cache.
void ENTRY(strata_pack_x_bf16)(const float* x, int64_t M, int64_t Mp, int64_t K, uint16_t* out) {
  const int64_t chunks = (K + KC - 1) / KC;
  std::memset(out, 0, sizeof(uint16_t) * size_t(chunks * Mp * KC));
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; k += 16) {  // K is a multiple of 32
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * K + k));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (k / KC * Mp + r) * KC + k % KC), (__m256i)h);
    }
}

// A panel's codes [kc/4][16][4] (u = q + offset, strata_pack_codes: Q4_1's nibbles),
// scales [kc/16][16] and minimums [kc/32][16] -> [kc/2][16][2] bf16 words of u - 8, the
// scales [kc/32][16] and the minimums m + 8 d in place: per 4 weights,
// a byte shuffle puts each column's first two codes (then its last two) in words, and `vpermw`
// looks each word up in a table of the 16 values. (The file's blocks; repacked rows go straight
// to words: strata_pack_q4_r8_bf16.)
void ENTRY(strata_codes_bf16)(const uint8_t* codes, const float* s, int64_t kc, uint16_t* w, float* d, float* m) {
  for (int64_t i = 0; i < kc / 32; ++i)
    for (int col = 0; col < 16; ++col) {
      d[16 * i + col] = s[32 * i + col];
      m[16 * i + col] += 8.0f * d[16 * i + col];
    }
  const __m512i table = _mm512_load_si512(CENTRED.bf16);
  constexpr char Z = char(0x80);  // a zero byte
  const __m512i first = _mm512_broadcast_i32x4(_mm_setr_epi8(0, Z, 1, Z, 4, Z, 5, Z, 8, Z, 9, Z, 12, Z, 13, Z));
  const __m512i last = _mm512_broadcast_i32x4(_mm_setr_epi8(2, Z, 3, Z, 6, Z, 7, Z, 10, Z, 11, Z, 14, Z, 15, Z));
  for (int64_t quad = 0; quad < kc / 4; ++quad) {
    const __m512i u = _mm512_loadu_si512(codes + 64 * quad);
    _mm512_storeu_si512(w + 64 * quad, _mm512_permutexvar_epi16(_mm512_shuffle_epi8(u, first), table));
    _mm512_storeu_si512(w + 64 * quad + 32, _mm512_permutexvar_epi16(_mm512_shuffle_epi8(u, last), table));
  }
}

// The same straight from Q4_1_R8 rows (repack.cpp: per group of eight rows and block
// of 32 weights the eight d and m as halves, then four quads, row k's four bytes of quad q at
// 32 q + 4 k: file bytes 4 q .. 4 q + 3, weights 4 q + c in the low nibbles, 16 + 4 q + c in
// the high ones): `rows` (8 or 16) rows rb bytes apart from src's group start, blocks [k0 / 32,
// (k0 + kc) / 32) -> w [kc/2][16][2] bf16 words of the nibbles - 8, d [kc/32][16] and m +
// 8 d [kc/32][16] as floats; columns past `rows` with scales zero. No panel of the file's blocks
// or of codes in between: short prompts pay for a panel's unpacking per 8 rows of x.
void ENTRY(strata_pack_q4_r8_bf16)(const uint8_t* src, int64_t rb, int rows, int64_t k0, int64_t kc, uint16_t* w,
                                   float* d, float* m) {
  constexpr int64_t gb = 160, codes = 32;  // a group's block, its codes' place
  const __m512i table = _mm512_load_si512(CENTRED.bf16);
  const __m512i first = _mm512_load_si512(PICK.words[0]), last = _mm512_load_si512(PICK.words[1]);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t i = 0; i < kc / 32; ++i) {
    const uint8_t* a = src + (k0 / 32 + i) * gb;
    const uint8_t* b = rows > 8 ? a + 8 * rb : nullptr;
    for (int half = 0; half < 2; ++half) {  // a group's eight d (then m) as halves, side by side
      const uint8_t* at = half ? b : a;
      const __m256 dh = at ? halves(at) : _mm256_setzero_ps();
      const __m256 mh = at ? halves(at + 16) : _mm256_setzero_ps();
      _mm256_storeu_ps(d + 16 * i + 8 * half, dh);
      _mm256_storeu_ps(m + 16 * i + 8 * half, _mm256_add_ps(mh, _mm256_mul_ps(_mm256_set1_ps(8.0f), dh)));
    }
    for (int q = 0; q < 4; ++q) {
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + codes + 32 * q));
      const __m256i qb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + codes + 32 * q))
                           : _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {  // the low nibbles: weights 4 q + c; the high: 16 + 4 q + c
        const __m512i ua = _mm512_cvtepu8_epi16(_mm256_and_si256(half ? _mm256_srli_epi16(qa, 4) : qa, low));
        const __m512i ub = _mm512_cvtepu8_epi16(_mm256_and_si256(half ? _mm256_srli_epi16(qb, 4) : qb, low));
        const int64_t pair = 16 * i + 8 * half + 2 * q;  // weights 2 pair, 2 pair + 1 of the panel
        const __m512i lo = _mm512_permutex2var_epi16(ua, first, ub), hi = _mm512_permutex2var_epi16(ua, last, ub);
        _mm512_storeu_si512(w + 32 * pair, _mm512_permutexvar_epi16(lo, table));
        _mm512_storeu_si512(w + 32 * (pair + 1), _mm512_permutexvar_epi16(hi, table));
      }
    }
  }
}

// y[:, 0:cols] (rows ldy apart, cols <= 16) = (k0 > 0 ? y : 0) + the share of weights [k0, k0 + kc)
// of the panel (w [kc/2][16][2] words, s [kc/32][16] scales, m [kc/32][16] minimums + 8 scales:
// strata_pack_q4_r8_bf16's or strata_codes_bf16's) for every row of x: xb strata_pack_x_bf16's (Mp
// = M rounded up to 8), xs [Mp, K/32] each block's sum of x. tmp: 128 floats.
void ENTRY(strata_prompt_panel_bf16)(const uint16_t* xb, const float* xs, int64_t M, int64_t Mp, int64_t K,
                                     int64_t k0, int64_t kc, const uint16_t* w, const float* s, const float* m,
                                     float* y, int64_t ldy, int cols, float* tmp) {
  const int64_t C = K / 32;
  const bool accumulate = k0 > 0;
  for (int64_t r0 = 0; r0 < M; r0 += MR) {
    const uint16_t* x = xb + (k0 / KC * Mp + r0) * KC;
    const float* sums = xs + r0 * C + k0 / 32;
    const int rows = int(M - r0 < MR ? M - r0 : MR);
    tile_at_edge<MR, NR>(y + r0 * ldy, ldy, rows, cols, accumulate, tmp, [&](float* out, int64_t ldc) {
      tile(x, K, sums, w, s, m, kc, out, ldc, accumulate);
    });
  }
}

}  // extern "C"
