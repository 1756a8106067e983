// The prompt's product in integers where the CPU has no AMX: y = x @ W^T with x quantized per 32
// as the decode step's `mm` quantizes it (xq int8, dx, xs: kernel.cpp strata_quantize_x) and W's
// codes (kernel.cpp strata_pack_codes, or straight from repacked rows: strata_pack_q32_r8_codes
// and the K-quants' below) multiplied four bytes at a time: with AVX-512 VNNI (AMD Zen 4 and 5,
// Intel Ice Lake) by `vpdpbusd`, 32 products in one instruction against the 16 of a bf16
// `vdpbf16ps` (oneDNN's slabs, what this replaces there); on AVX2 alone (AMD Zen 2 and 3, Intel
// before Ice Lake) by `maddubs` against prompt.cpp's float32 `fma`; no slab of the weights
// written and read again per chunk either way.
//
// The codes are unsigned bytes u = q + offset (the instruction multiplies unsigned by signed):
// q the exact integer weight of kernel.cpp's codes, offset the type's (0, 8, 16, 32 or 128:
// dequant.cpp strata_code_offset), so per group of G weights (32; 16 for Q6_K, whose scales
// are per 16) and activation row the exact integer sum of q * xq is sum(u * xq) - offset *
// sum(xq) (int32, < 2^21 in magnitude: converted to float exactly), then
//   y += (that * dx) * s   and, per 32, y += m * xs   (K-quants' and Q4_1 / Q5_1's minimums)
// one fused chain of float operations per output over k in order: a row's result is the same bits
// whatever the other rows of the call, its position in a tile or the thread that ran it, so a
// chunk goes in one call (as prompt.cpp's float32 product).
//
// The shape is prompt.cpp's: a panel of 16 output columns, 256 weights deep ([64][16][4] code
// bytes, 4 KB, and its scales: in L1), passed over by every 4-row micro-panel of x, a 4 x 16 tile
// of y in eight registers (two of 8 columns per row), eight int32 registers for the group's sums.
// Wide (Q4_1: layouts.h `takes_x16`, as its decode products): x quantized per 32 to 16
// bits (kernel.cpp strata_quantize_x16: each chunk's 64 bytes its high bytes xh, then its low ones
// xl), each group's sum 256 * sum(u * xh) + sum(xl * u), the codes the signed operand of the
// second (0..15), exact; twice the instructions, activations finer than bf16's.
// Two builds (build.py), the same integer sums (group_sums below), so the same bits.
#include "layouts.h"

namespace {

constexpr int MR = 4, NR = 16;

// coarse groups with an offset; coarse with minimums; Q6_K; the offset-128 types (Q8_0, IQ)
enum Kind { Offset, Minimum, Fine, Signed };

// Where a group's integer sums still hold the offset times its sum of xq (corr): the AVX2 build
// multiplies Signed's codes as q (below), not as q + 128
template <Kind kind>
constexpr bool takes_back() {
#ifdef STRATA_VNNI
  return kind != Minimum;
#else
  return kind != Minimum && kind != Signed;
#endif
}

// y (eight outputs of one row) += group g's share: its exact integer sums a (sum(u * xq), or
// with takes_back the offset's share corr still in them) times the row's chunk scale d and the
// eight columns' scales s, then the minimums m times the chunk's sum of x (xs): one fused chain
// per output, the same in both builds
template <Kind kind>
[[gnu::always_inline]] inline __m256 add_group(__m256 y, __m256i a, const int32_t* corr, float d, __m256 s,
                                               const float* m, float xs) {
  if constexpr (takes_back<kind>()) a = _mm256_sub_epi32(a, _mm256_set1_epi32(*corr));
  y = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(d)), s, y);
  if constexpr (kind == Minimum) y = _mm256_fmadd_ps(_mm256_loadu_ps(m), _mm256_set1_ps(xs), y);
  return y;
}

// Row r's four activation bytes of quad q of group g (Wide: its high bytes, or at +32 its low
// ones), broadcast to every 32-bit lane (`vpbroadcastd`: on AMD Zen 3 faster here than
// `vbroadcastss`)
template <Kind kind, bool Wide>
[[gnu::always_inline]] inline __m256i quad_x(const int8_t* x, int64_t K, int r, int64_t g, int q, int low = 0) {
  constexpr int Q = (kind == Fine ? 16 : 32) / 4;
  const int8_t* at = Wide ? x + r * 2 * K + 64 * g + 4 * q + 32 * low : x + r * K + 4 * (g * Q + q);
  int32_t four;
  std::memcpy(&four, at, 4);
  return _mm256_set1_epi32(four);
}

// a[r][j] = group g's exact integer sums for x row r and the panel's columns 8j..8j+7: sum(u * xq)
// (Wide: 256 * sum(u * xh) + sum(xl * u)).
// VNNI: `vpdpbusd`, four bytes of u times four of xq an instruction.
// AVX2: `maddubs` (int16 pairs of u * xq) summed in int16 over Span quads, then widened by `madd`:
// Span is the most quads whose pairs cannot reach 2^15 (ops.cpp's `top`, the codes' largest
// value: 8 for 4-bit codes, 4 for 5-bit and Wide, 2 for Q6_K, Wide's xl * u alike); Signed's codes
// (u = q + 128, whose pairs could) multiply as |q| times xq with q's sign (xq is never -128), so
// its sums are sum(q * xq) (`takes_back`). Integer sums either way: both builds give the same bits.
template <Kind kind, bool Wide, int Span>
[[gnu::always_inline]] inline void group_sums(const int8_t* x, int64_t K, const uint8_t* w, int64_t g,
                                              __m256i (&a)[MR][2]) {
  constexpr int Q = (kind == Fine ? 16 : 32) / 4;  // quads a group
  __m256i lo[MR][2];  // Wide's low bytes' sums
  for (int r = 0; r < MR; ++r) a[r][0] = a[r][1] = lo[r][0] = lo[r][1] = _mm256_setzero_si256();
  const auto codes = [&](int q, int j) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * (g * Q + q) + 32 * j));
  };
#ifdef STRATA_VNNI
#pragma GCC unroll 8
  for (int q = 0; q < Q; ++q) {
    const __m256i w0 = codes(q, 0), w1 = codes(q, 1);
    for (int r = 0; r < MR; ++r) {
      const __m256i xh = quad_x<kind, Wide>(x, K, r, g, q);
      a[r][0] = _mm256_dpbusd_epi32(a[r][0], w0, xh);
      a[r][1] = _mm256_dpbusd_epi32(a[r][1], w1, xh);
      if constexpr (Wide) {
        const __m256i xl = quad_x<kind, Wide>(x, K, r, g, q, 1);
        lo[r][0] = _mm256_dpbusd_epi32(lo[r][0], xl, w0);
        lo[r][1] = _mm256_dpbusd_epi32(lo[r][1], xl, w1);
      }
    }
  }
#else
  static_assert(Q % Span == 0 && (kind != Signed || Span == 1));
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  for (int q0 = 0; q0 < Q; q0 += Span) {
    __m256i p[MR][2], pl[MR][2];  // pl: Wide's low bytes' pairs
    for (int r = 0; r < MR; ++r) p[r][0] = p[r][1] = pl[r][0] = pl[r][1] = _mm256_setzero_si256();
    // unrolled twice, not more: on Zen 3 a full unroll's schedule spills (1.2x slower)
#pragma GCC unroll 2
    for (int q = q0; q < q0 + Span; ++q) {
      __m256i u[2] = {codes(q, 0), codes(q, 1)}, magnitude[2];
      if constexpr (kind == Signed)
        for (int j = 0; j < 2; ++j) u[j] = _mm256_xor_si256(u[j], flip), magnitude[j] = _mm256_abs_epi8(u[j]);
      for (int r = 0; r < MR; ++r) {
        const __m256i xh = quad_x<kind, Wide>(x, K, r, g, q);
        for (int j = 0; j < 2; ++j) {
          if constexpr (kind == Signed)  // |q| as unsigned: -128 too
            p[r][j] = _mm256_maddubs_epi16(magnitude[j], _mm256_sign_epi8(xh, u[j]));
          else
            p[r][j] = _mm256_add_epi16(p[r][j], _mm256_maddubs_epi16(u[j], xh));
          if constexpr (Wide)
            pl[r][j] = _mm256_add_epi16(pl[r][j], _mm256_maddubs_epi16(quad_x<kind, Wide>(x, K, r, g, q, 1), u[j]));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) {
        a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(p[r][j], ones));
        if constexpr (Wide) lo[r][j] = _mm256_add_epi32(lo[r][j], _mm256_madd_epi16(pl[r][j], ones));
      }
  }
#endif
  if constexpr (Wide)
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j) a[r][j] = _mm256_add_epi32(_mm256_slli_epi32(a[r][j], 8), lo[r][j]);
}

// c[MR][NR] (ldc apart) = (accumulate ? c : 0) + the tile's share of k in [k0, k0 + kc): x rows
// (K apart) from column k0, dx / xs rows (K / 32 apart) and corr rows (offset * each group's sum
// of xq, K / G apart) from k0's chunk and group; w, s, m the panel's codes, scales, minimums.
template <Kind kind, bool Wide, int Span>
inline void tile(const int8_t* x, int64_t K, const float* dx, const float* xs, const int32_t* corr, const uint8_t* w,
                 const float* s, const float* m, int64_t kc, float* c, int64_t ldc, bool accumulate) {
  constexpr int G = kind == Fine ? 16 : 32;
  const int64_t C = K / 32, CG = K / G;
  static_assert(!Wide || G == 32);
  __m256 y[MR][2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2; ++j) y[r][j] = accumulate ? _mm256_loadu_ps(c + r * ldc + 8 * j) : _mm256_setzero_ps();
  for (int64_t g = 0; g < kc / G; ++g) {
    __m256i a[MR][2];
    group_sums<kind, Wide, Span>(x, K, w, g, a);
    const int64_t chunk = g * G / 32;
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 2; ++j)
        y[r][j] = add_group<kind>(y[r][j], a[r][j], corr + r * CG + g, dx[r * C + chunk],
                                  _mm256_loadu_ps(s + NR * (g * G / 16) + 8 * j), m + NR * chunk + 8 * j,
                                  xs[r * C + chunk]);
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 2; ++j) _mm256_storeu_ps(c + r * ldc + 8 * j, y[r][j]);
}

template <Kind kind, bool Wide, int Span>
void panel(const int8_t* xq, const float* dx, const float* xs, const int32_t* corr, int64_t M, int64_t K,
           int64_t k0, int64_t kc, const uint8_t* w, const float* s, const float* m, float* y, int64_t ldy,
           int cols, float* tmp) {
  constexpr int G = kind == Fine ? 16 : 32;
  const int64_t C = K / 32, CG = K / G;
  const bool accumulate = k0 > 0;
  for (int64_t r0 = 0; r0 < M; r0 += MR) {  // x's rows are padded to a multiple of MR (zeros)
    const int8_t* x = xq + (Wide ? 2 : 1) * (r0 * K + k0);
    const float* d = dx + r0 * C + k0 / 32;
    const float* sums = xs + r0 * C + k0 / 32;
    const int32_t* off = corr + r0 * CG + k0 / G;
    float* c = y + r0 * ldy;
    const int rows = int(M - r0 < MR ? M - r0 : MR);
    tile_at_edge<MR, NR>(c, ldy, rows, cols, accumulate, tmp, [&](float* out, int64_t ldc) {
      tile<kind, Wide, Span>(x, K, d, sums, off, w, s, m, kc, out, ldc, accumulate);
    });
  }
}

// A group's eight IEEE halves at `at` as floats (exact), and its 32 bytes there; zeros for a
// group past the panel's rows (at null)
inline __m256 halves(const uint8_t* at) {
  return at ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))) : _mm256_setzero_ps();
}

inline __m256i bytes32(const uint8_t* at) {
  return at ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)) : _mm256_setzero_si256();
}

// bit `bit` of every byte of v moved to bit 4 (a fifth or high bit joining its nibble)
inline __m256i bit_to_4(__m256i v, int bit) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, bit), _mm256_set1_epi8(1)), 4);
}

}  // namespace

extern "C" {

// A panel's codes straight from the 32-weight types' repacked rows (Q4_0_R8 .. Q8_0_R8), as
// strata_pack_codes makes them from the file's blocks (the same bytes and scales). repack.cpp
// keeps per group of eight rows and block the eight d (then Q4_1 / Q5_1's m) as halves, Q5's
// fifth bits (row k's four bytes at 4k, byte c's bit t: weight 4t + c's), then the codes by quad,
// row k's file bytes 4q..4q+3 at 32q + 4k (Q4 / Q5: weights 4q + c in their low nibbles, 16 + 4q
// + c in the high ones; Q8_0: eight quads of bytes), which is already the panel's [4 weights][8
// rows][4] order: u = q + the type's offset is the nibble (with its fifth bit), or Q8_0's byte +
// 128. `rows` (8 or 16) rows rb bytes apart from a group's start, blocks [k0 / 32, (k0 + kc) /
// 32) -> codes [kc/4][16][4], scales [kc/16][16], minimums [kc/32][16]; columns past `rows` zero.
// No restoring to the file's bytes and unpacking them (8 % of a 1.7B Q4_0 file's prompt,
// docs/bench-log.md Dec 7 seventh session).
void ENTRY(strata_pack_q32_r8_codes)(int qtype, const uint8_t* src, int64_t rb, int rows, int64_t k0, int64_t kc,
                                     uint8_t* codes, float* s, float* m) {
  const bool mins = qtype == Q4_1 || qtype == Q5_1, five = qtype == Q5_0 || qtype == Q5_1, eight = qtype == Q8_0;
  const int high_at = mins ? 32 : 16, codes_at = high_at + (five ? 32 : 0), bytes = codes_at + (eight ? 256 : 128);
  const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(char(0x80));
  for (int64_t i = 0; i < kc / 32; ++i)
    for (int half = 0; half < 2; ++half) {  // rows 0-7, then 8-15: one group each
      const uint8_t* g = half == 0 || rows > 8 ? src + 8 * half * rb + (k0 / 32 + i) * bytes : nullptr;
      const auto at = [&](int offset) { return bytes32(g ? g + offset : nullptr); };
      const auto put = [&](int64_t quad, __m256i u) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 64 * (8 * i + quad) + 32 * half), u);
      };
      const __m256 d = halves(g);
      _mm256_storeu_ps(s + 16 * (2 * i) + 8 * half, d);
      _mm256_storeu_ps(s + 16 * (2 * i + 1) + 8 * half, d);
      if (mins) _mm256_storeu_ps(m + 16 * i + 8 * half, halves(g ? g + 16 : nullptr));
      if (eight) {
        for (int q = 0; q < 8; ++q) put(q, _mm256_xor_si256(at(codes_at + 32 * q), flip));
        continue;
      }
      const __m256i fifth = five ? at(high_at) : _mm256_setzero_si256();
      for (int q = 0; q < 4; ++q) {
        const __m256i b = at(codes_at + 32 * q);
        __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
        if (five) lo = _mm256_or_si256(lo, bit_to_4(fifth, q)), hi = _mm256_or_si256(hi, bit_to_4(fifth, 4 + q));
        put(q, lo);
        put(4 + q, hi);
      }
    }
}

// The same for Q4_K_R8 and Q5_K_R8 rows (repack.cpp: per group of eight rows and super-block the
// eight d and dmin as halves, each chunk's eight 6-bit scales and minimums as bytes, Q5_K's high
// bits, quad q's 32 bytes row k's qh[4q..4q+3] at 4k (bit c: chunk c's), then for each 64 weights
// j and quad q row k's file bytes 4q..4q+3 of qs[32j..] at 4k: chunk 2j's codes in their low
// nibbles, 2j + 1's in the high ones) -> codes [kc/4][16][4] (the nibbles, with Q5_K's fifth
// bit: the offset is 0), scales [kc/16][16] d * sc and minimums [kc/32][16] -(dmin * m), the
// float products strata_pack_codes makes (kernel.cpp codes_avx2), so the same bits.
void ENTRY(strata_pack_q45_k_r8_codes)(int qtype, const uint8_t* src, int64_t rb, int rows, int64_t k0, int64_t kc,
                                       uint8_t* codes, float* s, float* m) {
  const bool five = qtype == Q5_K;
  const int codes_at = five ? 416 : 160, bytes = five ? 1440 : 1184;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < kc / 256; ++i)
    for (int half = 0; half < 2; ++half) {  // rows 0-7, then 8-15: one group each
      const uint8_t* g = half == 0 || rows > 8 ? src + 8 * half * rb + (k0 / 256 + i) * bytes : nullptr;
      const auto at = [&](int offset) { return bytes32(g ? g + offset : nullptr); };
      const auto widened = [&](int offset) {  // eight unsigned bytes -> floats (g set)
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + offset))));
      };
      const __m256 zero = _mm256_setzero_ps(), d = halves(g), dmin = halves(g ? g + 16 : nullptr);
      for (int c = 0; c < 8; ++c) {
        const __m256 sc = g ? _mm256_mul_ps(d, widened(32 + 8 * c)) : zero;
        const __m256 mn = g ? _mm256_xor_ps(_mm256_mul_ps(dmin, widened(96 + 8 * c)), sign) : zero;
        _mm256_storeu_ps(s + 16 * (16 * i + 2 * c) + 8 * half, sc);
        _mm256_storeu_ps(s + 16 * (16 * i + 2 * c + 1) + 8 * half, sc);
        _mm256_storeu_ps(m + 16 * (8 * i + c) + 8 * half, mn);
      }
      for (int j = 0; j < 4; ++j)
        for (int q = 0; q < 8; ++q) {
          const __m256i b = at(codes_at + 32 * (8 * j + q)), high = five ? at(160 + 32 * q) : _mm256_setzero_si256();
          __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
          if (five) {
            lo = _mm256_or_si256(lo, bit_to_4(high, 2 * j));
            hi = _mm256_or_si256(hi, bit_to_4(high, 2 * j + 1));
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 64 * (64 * i + 16 * j + q) + 32 * half), lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 64 * (64 * i + 16 * j + 8 + q) + 32 * half), hi);
        }
    }
}

// The same for Q6_K_R8 rows (repack.cpp: per group of eight rows and super-block the eight d as
// halves, each 16 weights' eight int8 scales, then per 128 weights h the high bits, quad q's 32
// bytes row k's qh[32h + 4q..] at 4k (bits 2j, 2j + 1: chunk 4h + j's), and the low ones, source
// t's quad q row k's ql[64h + 32t + 4q..] at 4k (low nibbles: chunk 4h + t, high: 4h + t + 2))
// -> codes [kc/4][16][4] u = q + 32 (the six bits themselves), scales [kc/16][16] d * sc, as
// strata_pack_codes makes them.
void ENTRY(strata_pack_q6_k_r8_codes)(const uint8_t* src, int64_t rb, int rows, int64_t k0, int64_t kc,
                                      uint8_t* codes, float* s) {
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
  for (int64_t i = 0; i < kc / 256; ++i)
    for (int half = 0; half < 2; ++half) {  // rows 0-7, then 8-15: one group each
      const uint8_t* g = half == 0 || rows > 8 ? src + 8 * half * rb + (k0 / 256 + i) * 1680 : nullptr;
      const __m256 d = halves(g);
      for (int c = 0; c < 16; ++c) {
        const __m128i sc = g ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(g + 16 + 8 * c)) : _mm_setzero_si128();
        const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        _mm256_storeu_ps(s + 16 * (16 * i + c) + 8 * half, scale);
      }
      const auto at = [&](int offset) { return bytes32(g ? g + offset : nullptr); };
      for (int h = 0; h < 2; ++h)
        for (int q = 0; q < 8; ++q) {
          const int base = 144 + 768 * h;
          const __m256i qh = at(base + 32 * q), ql[2] = {at(base + 256 + 32 * q), at(base + 256 + 32 * (8 + q))};
          for (int j = 0; j < 4; ++j) {
            const __m256i lo = _mm256_and_si256(j < 2 ? ql[j] : _mm256_srli_epi16(ql[j - 2], 4), low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), two);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 64 * (64 * i + 32 * h + 8 * j + q) + 32 * half),
                                _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)));
          }
        }
    }
}

// corr [Mp, K / G] = offset * the sum of xq over each group of G weights (G 16 or 32), rows of
// xq [Mp, K] (wide: 16-bit, [Mp, 2K], G 32).
void ENTRY(strata_group_sums)(const int8_t* xq, int64_t Mp, int64_t K, int G, int offset, bool wide, int32_t* corr) {
  for (int64_t i = 0; i < Mp * K / G; ++i) corr[i] = offset * group_sum(xq, i, G, wide);
}

// y[:, 0:cols] (rows ldy apart, cols <= 16) = (k0 > 0 ? y : 0) + the share of weights [k0, k0 + kc)
// of the panel (w [kc/4][16][4] codes, s [kc/16][16] scales, m [kc/32][16] minimums:
// strata_pack_codes) for every row of x: xq [Mp, K] (Mp = M rounded up to 4, zero rows), dx and
// xs [Mp, K/32], corr [Mp, K/G] (strata_group_sums; G 16 where fine, else 32). offset: the type's
// (dequant.cpp strata_code_offset; 0: it has minimums); top: its codes' largest value (15, 31,
// 63 or 255); fine: its scales are per 16 (Q6_K); wide: xq is 16-bit (kernel.cpp
// strata_quantize_x16, [Mp, 2K]; corr then offset * each group's sum of x16). tmp: 64 floats.
void ENTRY(strata_prompt_panel_int8)(const int8_t* xq, const float* dx, const float* xs, const int32_t* corr,
                                     int64_t M, int64_t K, int64_t k0, int64_t kc, const uint8_t* w, const float* s,
                                     const float* m, int offset, int top, bool fine, bool wide, float* y, int64_t ldy,
                                     int cols, float* tmp) {
  const auto run = [&]<Kind kind, bool Wide, int Span>() {
    panel<kind, Wide, Span>(xq, dx, xs, corr, M, K, k0, kc, w, s, m, y, ldy, cols, tmp);
  };
  if (fine)
    run.operator()<Fine, false, 2>();
  else if (offset == 128)
    run.operator()<Signed, false, 1>();
  else if (offset == 0)
    wide ? run.operator()<Minimum, true, 4>() : top > 15 ? run.operator()<Minimum, false, 4>()
                                                         : run.operator()<Minimum, false, 8>();
  else  // wide is Q4_1 alone (layouts.h takes_x16), which has minimums
    top > 15 ? run.operator()<Offset, false, 4>() : run.operator()<Offset, false, 8>();
}

}  // extern "C"
