// The decode product's inner loop: one row of a GGUF matrix (whole blocks) dotted with rows of
// activations, each block's integer codes multiplied by the activations and the block's (or
// sub-block's) scale applied once to their sum. No torch here: build.py compiles this file three
// times, for x86-64-v3 (AVX2 + FMA, STRATA_AVX2), for that with AVX-512 VNNI (STRATA_VNNI, below)
// and for the baseline, and ops.cpp picks one at run time; everything below and in layouts.h is
// file-local but the entry points, so no code compiled for one ISA can be linked into another.
//
// A row of blocks is first turned into "codes": signed int8 weights q (offsets subtracted,
// codebook values looked up, signs applied), a float scale per 16 weights and a float minimum per
// 32, so that every type's weight is w = s[e/16] * q[e] + m[e/32], the same real number as gguf's
// dequantize (the codes are exact integers; the scales d*sc are exact in float32). Then, per 32
// weights and activation row:
//   int8 activations (x quantized per 32 as llama.cpp does: x ~ dx * xq, xq in [-127, 127]):
//     sum_e w_e x_e ~ dx * (s0 * sum_{e<16} q_e xq_e + s1 * sum_{e>=16} q_e xq_e) + m * dx * sum xq
//     the integer sums exact (int16 pair sums, at most 2 * 128 * 127), one float rounding each;
//   float32 activations: the same with x itself, q_e * x_e in float32.
// Except on AVX2 with int8 activations: every type's dots read the packed bytes directly
// (dot_q45_k, dot_q6_k, dot_q32, dot_iq below; the repacked forms' dot_*_r8), the same integers
// per 32 and an exact float per chunk; ~3x the codes path's speed at one row for Q4_K, Q5_K,
// Q6_K, ~2x for the 32-weight types and the codebook types (IQ4_XS, IQ3_S: the codes path's bits).
// Built a third time on x86 (STRATA_VNNI: AVX-512 VNNI, AMD Zen 4 and Intel since Ice Lake /
// Sapphire Rapids): the 32-weight types' four-byte sums in one instruction, the same integers,
// so the same bits; ops.cpp picks it where the CPU has it.
// And on AVX2 with float32 activations (the head) for Q6_K, Q8_0, Q4_K and Q5_K: their dots
// (dot_q6_k_float, dot_q8_0_float, dot_q45_k_float) make each 32 codes in a register and then do
// dot_float's operations in its order, the codes path's bits.
#include "layouts.h"
#include <cstdlib>
#include <type_traits>
#include <vector>

namespace {

inline bool is_32(int qtype) {
  return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0;
}

inline bool has_min(int qtype) {
  return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K;
}

// One block's codes: q[block weights], s[weights / 16], m[weights / 32].
struct Codes {
  int8_t* q;
  float* s;
  float* m;
};

// 32-weight types (block layouts: dequant.cpp).
inline void codes_32(int qtype, const uint8_t* b, Codes c) {
  float d = f16(b), m = 0.0f;
  if (qtype == Q8_0) {
    std::memcpy(c.q, b + 2, 32);
  } else if (qtype == Q4_0 || qtype == Q4_1) {
    const uint8_t* qs = b + (qtype == Q4_1 ? 4 : 2);
    const int off = qtype == Q4_0 ? 8 : 0;
    for (int l = 0; l < 16; ++l) {
      c.q[l] = int8_t((qs[l] & 0x0F) - off);
      c.q[l + 16] = int8_t((qs[l] >> 4) - off);
    }
    if (qtype == Q4_1) m = f16(b + 2);
  } else {  // Q5_0, Q5_1
    const bool with_min = qtype == Q5_1;
    const uint8_t* p = b + (with_min ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    const int off = with_min ? 0 : 16;
    for (int l = 0; l < 16; ++l) {
      c.q[l] = int8_t(((qs[l] & 0x0F) | (((qh >> l) & 1) << 4)) - off);
      c.q[l + 16] = int8_t(((qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - off);
    }
    if (with_min) m = f16(b + 2);
  }
  c.s[0] = c.s[1] = d;
  c.m[0] = m;
}

// 256-weight types. kvalues: IQ4_XS's 16 codebook values; grid: IQ3_S's 512 x 4 bytes.
inline void codes_256(int qtype, const uint8_t* b, Codes c, const int8_t* kvalues, const uint8_t* grid) {
  switch (qtype) {
    case Q4_K:
    case Q5_K: {
      const bool five = qtype == Q5_K;
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      scale_min_k(b + 4, sc, mn);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (five ? 48 : 16);
      for (int s = 0; s < 8; ++s) {
        const uint8_t* q = qs + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        for (int l = 0; l < 32; ++l) {
          int v = (q[l] >> shift) & 0x0F;
          if (five) v |= ((qh[l] >> s) & 1) << 4;
          c.q[32 * s + l] = int8_t(v);
        }
        c.s[2 * s] = c.s[2 * s + 1] = d * float(sc[s]);  // gguf's (d * sc) * q - dmin * m
        c.m[s] = -(dmin * float(mn[s]));
      }
      break;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j) {
          const uint8_t* lo = ql + 64 * h + 32 * (j % 2);
          const int shift = 4 * (j / 2);
          int8_t* out = c.q + 128 * h + 32 * j;
          for (int l = 0; l < 32; ++l)
            out[l] = int8_t((((lo[l] >> shift) & 0x0F) | (((qh[32 * h + l] >> (2 * j)) & 3) << 4)) - 32);
        }
      for (int i = 0; i < 16; ++i) c.s[i] = d * float(scales[i]);
      for (int i = 0; i < 8; ++i) c.m[i] = 0.0f;
      break;
    }
    case IQ4_XS: {
      const float d = f16(b);
      uint16_t sh;
      std::memcpy(&sh, b + 2, 2);
      const uint8_t* sl = b + 4;
      const uint8_t* qs = b + 8;
      for (int s = 0; s < 8; ++s) {
        const int scale = (((sl[s / 2] >> (4 * (s % 2))) & 0x0F) | (((sh >> (2 * s)) & 3) << 4)) - 32;
        const uint8_t* q = qs + 16 * s;
        for (int l = 0; l < 16; ++l) {
          c.q[32 * s + l] = kvalues[q[l] & 0x0F];
          c.q[32 * s + l + 16] = kvalues[q[l] >> 4];
        }
        c.s[2 * s] = c.s[2 * s + 1] = d * float(scale);
        c.m[s] = 0.0f;
      }
      break;
    }
    case IQ3_S: {
      const float d = f16(b);
      const uint8_t* qs = b + 2;
      const uint8_t* qh = b + 66;
      const uint8_t* signs = b + 74;
      const uint8_t* scales = b + 106;
      for (int s = 0; s < 8; ++s) {
        const uint8_t* q = qs + 8 * s;
        const uint8_t* sg = signs + 4 * s;
        const int high = qh[s];
        for (int l = 0; l < 32; ++l) {
          const int g = l >> 2;
          const int v = grid[(int(q[g]) | (((high >> g) & 1) << 8)) * 4 + (l & 3)];
          c.q[32 * s + l] = int8_t((sg[l >> 3] >> (l & 7)) & 1 ? -v : v);
        }
        c.s[2 * s] = c.s[2 * s + 1] = d * float(1 + 2 * ((scales[s / 2] >> (4 * (s % 2))) & 0x0F));
        c.m[s] = 0.0f;
      }
      break;
    }
    default:
      break;
  }
}

#ifdef STRATA_AVX2
// The weights' codes with AVX2 (the same integers as the loops above, which the baseline build
// runs): 32 at a time; the scales still from the scalar code above.
inline __m256i bytes_from_bits(uint32_t bits) {  // byte e: 0xFF where bit e is set
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

inline __m256i nibbles_16(const uint8_t* qs) {  // elements 0-15 low nibbles of qs[0..16], 16-31 high
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

inline void store(int8_t* q, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), v); }

inline __m256i load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// A 32-weight block's codes in a register, unsigned as stored (Q4_0, Q5_0: before their -8 / -16;
// Q5's high bit << 4; Q8_0's bytes as they are): the fused dots' (below) and the codes path's.
template <int T>
inline __m256i codes_q32(const uint8_t* b) {
  if constexpr (T == Q8_0) {
    return load(b + 2);
  } else if constexpr (T == Q4_0 || T == Q4_1) {  // unsigned: Q4_0's -8 is its block's offset
    return nibbles_16(b + (T == Q4_1 ? 4 : 2));
  } else {  // Q5_0, Q5_1 (Q5_0's -16 likewise)
    const uint8_t* p = b + (T == Q5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    return _mm256_or_si256(nibbles_16(p + 4), _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
  }
}

inline __m256i codes_q32_of(int qtype, const uint8_t* b) {
  switch (qtype) {
    case Q8_0: return codes_q32<Q8_0>(b);
    case Q4_0: return codes_q32<Q4_0>(b);
    case Q4_1: return codes_q32<Q4_1>(b);
    case Q5_0: return codes_q32<Q5_0>(b);
    default: return codes_q32<Q5_1>(b);
  }
}

// IQ4_XS and IQ3_S: chunk k's (32 weights) integer scale and signed codes, from a super-block b
// (the codes path's and the fused dots' own).
inline int iq4_xs_scale(const uint8_t* b, int k) {
  return (((b[4 + k / 2] >> (4 * (k % 2))) & 0x0F) | (((b[2 + k / 4] >> (2 * (k % 4))) & 3) << 4)) - 32;
}

inline __m256i iq4_xs_codes(const uint8_t* b, int k, const int8_t* kvalues) {
  const __m256i values = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kvalues)));
  return _mm256_shuffle_epi8(values, nibbles_16(b + 8 + 16 * k));
}

inline int iq3_s_scale(const uint8_t* b, int k) { return 1 + 2 * ((b[106 + k / 2] >> (4 * (k % 2))) & 0x0F); }

// IQ3_S's magnitudes (its grid's values are 1..15) and signs (0xFF where a weight is negative)
inline __m256i iq3_s_grid(const uint8_t* b, int k, const uint8_t* grid) {
  // the eight grid entries' indices: qs's bytes, the ninth bit from qh's byte
  const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * k)));
  const __m256i ninth = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[66 + k]), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                         _mm256_set1_epi32(1));
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(grid), _mm256_or_si256(low, _mm256_slli_epi32(ninth, 8)), 4);
}

inline __m256i iq3_s_negative(const uint8_t* b, int k) {
  uint32_t bits;
  std::memcpy(&bits, b + 74 + 4 * k, 4);
  return bytes_from_bits(bits);
}

inline __m256i iq3_s_codes(const uint8_t* b, int k, const uint8_t* grid) {
  const __m256i negative = iq3_s_negative(b, k);
  return _mm256_sub_epi8(_mm256_xor_si256(iq3_s_grid(b, k, grid), negative), negative);
}

inline void codes_avx2(int qtype, const uint8_t* b, Codes c, const int8_t* kvalues, const uint8_t* grid) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  switch (qtype) {
    case Q8_0:  // in a register, not through codes_32 (its byte loops cost Q4_0 4x Q5_0's time)
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      c.s[0] = c.s[1] = f16(b);
      c.m[0] = has_min(qtype) ? f16(b + 2) : 0.0f;
      const char offset = qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : 0;
      store(c.q, _mm256_sub_epi8(codes_q32_of(qtype, b), _mm256_set1_epi8(offset)));
      return;
    }
    case Q4_K:
    case Q5_K: {
      const bool five = qtype == Q5_K;
      const float d = f16(b), dmin = f16(b + 2);
      uint8_t sc[8], mn[8];
      scale_min_k(b + 4, sc, mn);
      for (int s = 0; s < 8; ++s) {
        c.s[2 * s] = c.s[2 * s + 1] = d * float(sc[s]);
        c.m[s] = -(dmin * float(mn[s]));
      }
      const uint8_t* qs = b + (five ? 48 : 16);
      const __m256i qh = five ? load(b + 16) : _mm256_setzero_si256();
      const __m256i one = _mm256_set1_epi8(1);
      for (int j = 0; j < 4; ++j) {
        const __m256i v = load(qs + 32 * j);
        __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if (five) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
        }
        store(c.q + 64 * j, lo);
        store(c.q + 64 * j + 32, hi);
      }
      return;
    }
    case Q6_K: {
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      for (int i = 0; i < 16; ++i) c.s[i] = d * float(scales[i]);
      for (int i = 0; i < 8; ++i) c.m[i] = 0.0f;
      const __m256i three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; ++h) {
        const __m256i a = load(b + 64 * h), bb = load(b + 64 * h + 32), qh = load(b + 128 + 32 * h);
        const __m256i lo[4] = {_mm256_and_si256(a, low4), _mm256_and_si256(bb, low4),
                               _mm256_and_si256(_mm256_srli_epi16(a, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(bb, 4), low4)};
        for (int j = 0; j < 4; ++j) {
          const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), three), 4);
          store(c.q + 128 * h + 32 * j, _mm256_sub_epi8(_mm256_or_si256(lo[j], top), bias));
        }
      }
      return;
    }
    case IQ4_XS:
    case IQ3_S: {
      const float d = f16(b);
      for (int k = 0; k < 8; ++k) {
        c.s[2 * k] = c.s[2 * k + 1] = d * float(qtype == IQ4_XS ? iq4_xs_scale(b, k) : iq3_s_scale(b, k));
        c.m[k] = 0.0f;
        store(c.q + 32 * k, qtype == IQ4_XS ? iq4_xs_codes(b, k, kvalues) : iq3_s_codes(b, k, grid));
      }
      return;
    }
    default:
      return;
  }
}
#endif

#ifdef STRATA_AVX2
// Each int32 lane: the sum of its four bytes' products, u unsigned times v signed. Exact either
// way (no int16 pair of `maddubs` saturates here: at most 2 * 128 * 127), so the VNNI build's one
// instruction gives the AVX2 build's bits.
inline __m256i sums_of_four(__m256i u, __m256i v) {
#ifdef STRATA_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// bias[r] = the minimums' share of row r's sum: sum over chunks of m * (the chunk's sum of x_r).
template <int R>
inline void min_bias(const float* m, bool mins, const float* xs, int64_t C, float* bias) {
  for (int r = 0; r < R; ++r) {
    bias[r] = 0.0f;
    if (mins)
      for (int64_t c = 0; c < C; ++c) bias[r] += m[c] * xs[r * C + c];
  }
}

// f(R, r) for the activation rows in blocks of Most from row r, then the rest in one call: R as
// std::integral_constant<int, R> (1..Most), so each R is its own unrolled kernel.
template <int Most, typename F>
inline void in_blocks(int64_t M, F f) {
  static_assert(Most >= 1 && Most <= 8);
  auto with = [&](auto R, int64_t r) {
    if constexpr (decltype(R)::value <= Most) f(R, r);
  };
  for (int64_t r = 0; r < M; r += Most) {
    switch (M - r < Most ? M - r : Most) {
      case 8: with(std::integral_constant<int, 8>{}, r); break;
      case 7: with(std::integral_constant<int, 7>{}, r); break;
      case 6: with(std::integral_constant<int, 6>{}, r); break;
      case 5: with(std::integral_constant<int, 5>{}, r); break;
      case 4: with(std::integral_constant<int, 4>{}, r); break;
      case 3: with(std::integral_constant<int, 3>{}, r); break;
      case 2: with(std::integral_constant<int, 2>{}, r); break;
      default: with(std::integral_constant<int, 1>{}, r); break;
    }
  }
}

// y[r, n] for every activation row r, Most at a time, then the rest: dot(R, r, out) computes R
// rows from row r. Four for the codes path; eight for the fused dots below (their unpacking is a
// larger share of the work, and 5-8 rows in one pass measured 0-18 % faster than four and the rest).
template <int Most, typename Dot>
inline void in_rows(int64_t M, int64_t N, int64_t n, float* y, Dot dot) {
  float out[Most];
  in_blocks<Most>(M, [&](auto R, int64_t r) {
    dot(R, r, out);
    for (int i = 0; i < R; ++i) y[(r + i) * N + n] = out[i];
  });
}

// out[r] = sum over the row of w * x_r for R rows at once (the weights loaded once), int8
// activations: xq rows [K] codes, dx / xs rows [K/32] each chunk's scale and dx * sum(xq).
template <int R>
inline void dot_int8(const int8_t* q, const float* s, const float* m, bool mins, const int8_t* xq,
                     const float* dx, const float* xs, int64_t K, float* out) {
  const int64_t C = K / 32;
  float bias[R];
  min_bias<R>(m, mins, xs, C, bias);
#ifdef STRATA_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * c));
    const __m256i magnitude = _mm256_sign_epi8(w, w);  // |w| as unsigned: -128 too
    const __m256 scale = _mm256_set_m128(_mm_set1_ps(s[2 * c + 1]), _mm_set1_ps(s[2 * c]));  // lanes 0-3: e < 16
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + 32 * c));
      // |w| times x with w's sign: no int8 overflow (x is never -128), int16 pairs <= 2 * 128 * 127
      const __m256 sums = _mm256_cvtepi32_ps(sums_of_four(magnitude, _mm256_sign_epi8(x, w)));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, _mm256_broadcast_ss(dx + r * C + c)), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + bias[r];
#else
  for (int r = 0; r < R; ++r) {
    const int8_t* x = xq + r * K;
    float acc = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      int32_t lo = 0, hi = 0;
      for (int e = 0; e < 16; ++e) lo += int32_t(q[32 * c + e]) * x[32 * c + e];
      for (int e = 16; e < 32; ++e) hi += int32_t(q[32 * c + e]) * x[32 * c + e];
      const float d = dx[r * C + c];
      acc += float(lo) * (s[2 * c] * d) + float(hi) * (s[2 * c + 1] * d);
    }
    out[r] = acc + bias[r];
  }
#endif
}

// The same with float32 activations: x rows [K], xs rows [K/32] each chunk's sum of x. R rows at
// once, the codes turned to floats once for all of them (the head's exact pass at 8 rows spent
// most of its time converting); each row's operations are the same in the same order whatever
// R is, so a row's logit does not depend on what else shares the call.
template <int R>
inline void dot_float(const int8_t* q, const float* s, const float* m, bool mins, const float* x,
                      const float* xs, int64_t K, float* out) {
  const int64_t C = K / 32;
  float bias[R];
  min_bias<R>(m, mins, xs, C, bias);
#ifdef STRATA_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int8_t* w = q + 32 * c;
    __m256 f[4];
    for (int i = 0; i < 4; ++i) {
      __m128i b;
      std::memcpy(&b, w + 8 * i, 8);  // low 8 bytes
      f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
    const __m256 lo_scale = _mm256_set1_ps(s[2 * c]), hi_scale = _mm256_set1_ps(s[2 * c + 1]);
    for (int r = 0; r < R; ++r) {
      const float* v = x + r * K + 32 * c;
      const __m256 lo = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(v + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(v)));
      const __m256 hi = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(v + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(v + 16)));
      acc[r] = _mm256_fmadd_ps(lo, lo_scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(hi, hi_scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + bias[r];
#else
  for (int r = 0; r < R; ++r) {
    const float* v = x + r * K;
    float acc = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      float lo = 0.0f, hi = 0.0f;
      for (int e = 0; e < 16; ++e) lo += float(q[32 * c + e]) * v[32 * c + e];
      for (int e = 16; e < 32; ++e) hi += float(q[32 * c + e]) * v[32 * c + e];
      acc += lo * s[2 * c] + hi * s[2 * c + 1];
    }
    out[r] = acc + bias[r];
  }
#endif
}

#ifdef STRATA_AVX2
// Fused K-quant dots (AVX2, int8 activations): Q4_K, Q5_K and Q6_K straight from the packed
// bytes, no codes buffer. Per 32 weights and activation row: the unsigned codes (Q4_K 0..15,
// Q5_K 0..31, Q6_K 0..63, offset not subtracted) times xq with `maddubs` (int16 pairs <= 2 * 63
// * 127, no saturation), then `madd` with the sub-block's integer scale (Q6_K: one per 16, the
// two halves of the register), so each int32 lane is exact and < 2^24 (<= 2 * 63 * 127 * 128):
// one exact conversion and one fma by the chunk's dx; the super-block's sum times d once. The
// offsets are linear in the activations: the K-quants' minimums (-dmin * m per 32) times xs,
// Q6_K's -32 (-32 * d * sc per 16) times dx * (the 16's sum of xq), a vector fma per super-block.
// Every row's operations are the same whatever R is (a row's result does not depend on its
// neighbours, and mm_experts == mm of the row alone).

// A K-quant super-block's 8 six-bit sub-block scales and minimums as bytes (scale_min_k's).
inline void scale_min_k8(const uint8_t* s, uint64_t& sc, uint64_t& mn) {
  uint32_t a, b, c;
  std::memcpy(&a, s, 4);
  std::memcpy(&b, s + 4, 4);
  std::memcpy(&c, s + 8, 4);
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  sc = (a & 0x3F3F3F3Fu) | (uint64_t(sc_hi) << 32);
  mn = (b & 0x3F3F3F3Fu) | (uint64_t(mn_hi) << 32);
}

template <int C>  // byte e: 0x10 where bit C of bits[e] is set
inline __m256i bit_to_16(__m256i bits) {
  const __m256i b = _mm256_and_si256(bits, _mm256_set1_epi8(char(1 << C)));
  if constexpr (C < 4) return _mm256_slli_epi16(b, 4 - C);
  else if constexpr (C > 4) return _mm256_srli_epi16(b, C - 4);
  else return b;
}

// sb[r] (+)= the chunk's integer sum, scaled by the integer scales s, times dx
template <int R, bool First>
inline void chunk_int8(__m256i w, __m256i s, const int8_t* xq, const float* dx, int64_t K, int64_t C, __m256* sb) {
  for (int r = 0; r < R; ++r) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K));
    const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), s));
    const __m256 d = _mm256_broadcast_ss(dx + r * C);
    sb[r] = First ? _mm256_mul_ps(sums, d) : _mm256_fmadd_ps(sums, d, sb[r]);
  }
}

template <int R, bool Five>
inline void dot_q45_k(const uint8_t* row, const int8_t* xq, const float* dx, const float* xs, int64_t K, float* out) {
  constexpr int bytes = Five ? 176 : 144;
  const int64_t C = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R], sb[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* b = row + i * bytes;
    uint64_t sc, mn;
    scale_min_k8(b + 4, sc, mn);
    // the minimums: -(dmin * m) per 32 (exact in float32), times each chunk's dx * sum(xq)
    const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(-f16(b + 2)),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(mn)))));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + r * C + 8 * i), mins, acc[r]);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(int64_t(sc))));
    const uint8_t* qs = b + (Five ? 48 : 16);
    const __m256i qh = Five ? load(b + 16) : _mm256_setzero_si256();
    const int8_t* x = xq + 256 * i;
    const float* d = dx + 8 * i;
    auto pair = [&](auto J) {
      constexpr int j = decltype(J)::value;
      const __m256i v = load(qs + 32 * j);
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (Five) {
        lo = _mm256_or_si256(lo, bit_to_16<2 * j>(qh));
        hi = _mm256_or_si256(hi, bit_to_16<2 * j + 1>(qh));
      }
      const __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(short(0x0100 + 0x0202 * (2 * j))));
      const __m256i s_hi = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(short(0x0100 + 0x0202 * (2 * j + 1))));
      chunk_int8<R, j == 0>(lo, s_lo, x + 64 * j, d + 2 * j, K, C, sb);
      chunk_int8<R, false>(hi, s_hi, x + 64 * j + 32, d + 2 * j + 1, K, C, sb);
    };
    pair(std::integral_constant<int, 0>{});
    pair(std::integral_constant<int, 1>{});
    pair(std::integral_constant<int, 2>{});
    pair(std::integral_constant<int, 3>{});
    const __m256 scale = _mm256_set1_ps(f16(b));
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(sb[r], scale, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// Q4_K_R8, Q5_K_R8 and Q6_K_R8 (repack.cpp: eight weight rows at a time): out[8 r + k] = the dot of the
// group's weight row k with activation row r, for R rows. Lane k of every register is weight
// row k, so a chunk's float work (its integer sums converted, times d * sc * dx; Q4_K's minimum
// -dmin * mn times the chunk's dx * sum(xq), Q6_K's offset -32 d * sc times each 16's) is one
// operation for eight weight rows, and there are no horizontal sums: the one-row-at-a-time dots
// (dot_q45_k, dot_q6_k) spend most of their operations there from one row to eight. The integer
// sums are exact in both builds (VNNI: `vpdpbusd`; AVX2: `maddubs` pairs, widened by `madd`),
// so both give the same bits. Per output the float operations are fixed, whatever R, the thread
// or the rows beside it: per scale group in order acc = fma(isum, (d * sc) * dx, acc) and
// part = fma(minimum or offset, its sum, part); out = acc + part.
inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <bool Signed>
inline __m256 bytes8(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// Four activation bytes in every lane: `vpbroadcastd`, not `vbroadcastss` (a float's, whose
// integer users wait a domain crossing on AMD Zen 3): a 1.7B-shaped Q4_0 decode 1.09x / 1.12x at
// 1 / 4 rows there (docs/bench-log.md, Dec 7 eighth session)
inline __m256i quad_of(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  return _mm256_set1_epi32(four);
}

// Five: Q5_K_R8, each code's fifth bit from the high bits' quads (bit c: chunk c's)
template <int R, bool Five>
inline void dot_q45_k_r8(const uint8_t* group, const int8_t* xq, const float* dx, const float* xs, int64_t K,
                         float* out) {
  const int64_t C = K / 32;
  constexpr int64_t bytes = Five ? 1440 : 1184, codes_at = Five ? 416 : 160;
#ifdef STRATA_VNNI
  constexpr int chains = R <= 2 ? 2 : 1;  // one or two rows: two chains of vpdpbusd, not one long one
#else
  constexpr int chains = 1;
#endif
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  __m256 acc[R], mins[R];
  for (int r = 0; r < R; ++r) acc[r] = mins[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* o = group + i * bytes;
    const __m256 d = halves8(o), dmin = _mm256_sub_ps(_mm256_setzero_ps(), halves8(o + 16));
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // chunk 2j in the low nibbles, 2j + 1 in the high
        const int64_t c = 8 * i + 2 * j + h;
        const int bit = 2 * j + h;  // the chunk's high bit in Q5_K's qh bytes
        __m256i sum[R][chains], wide[R];
        for (int r = 0; r < R; ++r) {
          wide[r] = _mm256_setzero_si256();
          for (int e = 0; e < chains; ++e) sum[r][e] = _mm256_setzero_si256();
        }
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          const __m256i nib = load(o + codes_at + 32 * (8 * j + q));
          __m256i codes = _mm256_and_si256(h ? _mm256_srli_epi16(nib, 4) : nib, low4);
          if constexpr (Five) {  // bit `bit` of each qh byte to bit 4 (16-bit shifts: the mask keeps the byte's own)
            const __m256i qh = load(o + 160 + 32 * q);
            const __m256i high = bit < 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - bit))
                                         : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(bit - 4));
            codes = _mm256_or_si256(codes, _mm256_and_si256(high, bit4));
          }
          for (int r = 0; r < R; ++r) {
            const __m256i x = quad_of(xq + r * K + 32 * c + 4 * q);
#ifdef STRATA_VNNI
            sum[r][q % chains] = _mm256_dpbusd_epi32(sum[r][q % chains], codes, x);
#else  // |pair| <= 2 * 15 * 127: eight quads summed as int16 stay below 2^15; Q5_K's 2 * 31 * 127: four
            sum[r][0] = _mm256_add_epi16(sum[r][0], _mm256_maddubs_epi16(codes, x));
            if (Five && q == 3) {
              wide[r] = _mm256_madd_epi16(sum[r][0], _mm256_set1_epi16(1));
              sum[r][0] = _mm256_setzero_si256();
            }
#endif
          }
        }
        const __m256 s = _mm256_mul_ps(d, bytes8<false>(o + 32 + 8 * (2 * j + h)));  // d * sc: exact
        const __m256 m = _mm256_mul_ps(dmin, bytes8<false>(o + 96 + 8 * (2 * j + h)));  // -(dmin * mn): exact
        for (int r = 0; r < R; ++r) {
#ifdef STRATA_VNNI
          __m256i total = sum[r][0];
          if constexpr (chains == 2) total = _mm256_add_epi32(total, sum[r][1]);
#else
          const __m256i total = _mm256_add_epi32(wide[r], _mm256_madd_epi16(sum[r][0], _mm256_set1_epi16(1)));
#endif
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * C + c)), acc[r]);
          mins[r] = _mm256_fmadd_ps(m, _mm256_broadcast_ss(xs + r * C + c), mins[r]);
        }
      }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], mins[r]));
}

// x16: rows [K/16] of dx * (each 16's sum of xq), for the codes' +32
template <int R>
inline void dot_q6_k_r8(const uint8_t* group, const int8_t* xq, const float* dx, const float* x16, int64_t K,
                        float* out) {
  const int64_t C = K / 32, G = K / 16;
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  __m256 acc[R], offs[R];
  for (int r = 0; r < R; ++r) acc[r] = offs[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* o = group + i * 1680;
    const __m256 d = halves8(o);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // chunk 4h + j: ql's low (j < 2) or high nibbles, qh's bits 2j, 2j + 1
        const int64_t c = 8 * i + 4 * h + j;
        __m256i sum[R][2];  // the chunk's two groups of 16: quads 0-3 and 4-7
        for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = 0; q < 8; ++q) {
          const uint8_t* half = o + 144 + 768 * h;  // repack.cpp: its qh, then ql's two sources
          const __m256i qh = load(half + 32 * q), nib = load(half + 256 + 32 * (8 * (j % 2) + q));
          // the four bits, and the two high ones at bits 4-5 (16-bit shifts: no bit crosses a byte
          // that the mask keeps)
          const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(nib, 4 * (j / 2)), low4);
          const __m256i hb = j < 2 ? _mm256_slli_epi16(qh, 4 - 2 * j) : _mm256_srli_epi16(qh, 2 * j - 4);
          const __m256i codes = _mm256_or_si256(lo, _mm256_and_si256(hb, top2));  // q + 32, 0..63
          for (int r = 0; r < R; ++r) {
            const __m256i x = quad_of(xq + r * K + 32 * c + 4 * q);
#ifdef STRATA_VNNI
            sum[r][q / 4] = _mm256_dpbusd_epi32(sum[r][q / 4], codes, x);
#else  // |pair| <= 2 * 63 * 127: widened per quad
            sum[r][q / 4] = _mm256_add_epi32(sum[r][q / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
#endif
          }
        }
        for (int e = 0; e < 2; ++e) {
          const int g = 2 * (4 * h + j) + e;  // the group of 16 in the super-block
          const __m256 s = _mm256_mul_ps(d, bytes8<true>(o + 16 + 8 * g));  // d * sc: exact
          const __m256 offset = _mm256_mul_ps(s, _mm256_set1_ps(-32.0f));  // exact
          for (int r = 0; r < R; ++r) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r][e]), _mm256_mul_ps(s, _mm256_broadcast_ss(dx + r * C + c)), acc[r]);
            offs[r] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(x16 + r * G + 16 * i + g), offs[r]);
          }
        }
      }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], offs[r]));
}

// Q4_0_R8, Q4_1_R8, Q5_0_R8, Q5_1_R8 and Q8_0_R8 (T: the file's type), as dot_q45_k_r8: per block
// (32 weights) the exact integer sum of (q - offset) * xq for eight weight rows (Q4_0's offset 8,
// Q5_0's 16 taken back as offset * sum(xq), an integer; Q8_0's signed bytes: |q| times xq with
// q's sign on AVX2, q + 128 as unsigned bytes and 128 * sum(xq) taken back on VNNI), converted
// once, acc = fma(isum, d * dx, acc), and Q4_1 / Q5_1's minimum part = fma(m, dx * sum(xq), part).
// sums: rows [K/32] of each block's sum(xq).
// Q4_1 (layouts.h `takes_x16`: the default file's type) takes 16-bit activations: x quantized per 32 to x16 in [-32767, 32767]
// (strata_quantize_x16), each chunk's 64 bytes its high bytes xh (signed) then its low ones xl
// (unsigned), x16 = 256 xh + xl; the block's sum is 256 * sum(q * xh) + sum(xl * q), each part
// four bytes at a time as above (xl the unsigned operand, the codes 0..15 the signed one), exact
// (|sum(q * x16)| <= 32 * 15 * 32767 < 2^24). Twice the integer work, and activations as fine
// as 2^-15 of their chunk's largest rather than 2^-7: closer to float32 than bf16.
template <int R, int T>
inline void dot_q32_r8(const uint8_t* group, const int8_t* xq, const float* dx, const float* xs, const int32_t* sums,
                       int64_t K, float* out) {
  constexpr bool mins = T == Q4_1 || T == Q5_1, five = T == Q5_0 || T == Q5_1, eight = T == Q8_0;
  constexpr bool fine = takes_x16(T + EIGHT_ROWS);
  constexpr int64_t row = fine ? 2 : 1, chunk = fine ? 64 : 32;  // xq's bytes a weight, a chunk
  constexpr int high_at = mins ? 32 : 16, codes_at = high_at + (five ? 32 : 0), bytes = codes_at + (eight ? 256 : 128);
#ifdef STRATA_VNNI
  constexpr int offset = T == Q4_0 ? 8 : T == Q5_0 ? 16 : eight ? 128 : 0;
  constexpr int chains = R <= 2 ? 2 : 1;  // one or two rows: two chains of vpdpbusd, not one long one
#else
  constexpr int offset = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;  // Q8_0: signs, no offset
#endif
  const int64_t C = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  __m256 acc[R], part[R];
  for (int r = 0; r < R; ++r) acc[r] = part[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* o = group + c * bytes;
#ifdef STRATA_VNNI
    __m256i sum[R][chains], low[R];  // low: fine x's low bytes' sums
    for (int r = 0; r < R; ++r) {
      for (int e = 0; e < chains; ++e) sum[r][e] = _mm256_setzero_si256();
      low[r] = _mm256_setzero_si256();
    }
#else
    __m256i sum[R], wide[R], low[R], low_wide[R];  // int16 pairs' sums (|pair| <= 2 * 15 * 128: eight
    // quads; Q5's 2 * 31 * 127 and fine x's low bytes' 2 * 255 * 15: four; Q8_0's 2 * 128 * 127:
    // one), widened into int32
    for (int r = 0; r < R; ++r) sum[r] = wide[r] = low[r] = low_wide[r] = _mm256_setzero_si256();
#endif
    const __m256i high = five ? load(o + high_at) : _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {  // lane k's byte b: weight 4q + b of row k
      __m256i codes;
      if constexpr (eight) {
        codes = load(o + codes_at + 32 * q);
      } else {  // quads 0-3 the low nibbles, 4-7 the high; the fifth bits at bit q of each byte
        const __m256i nib = load(o + codes_at + 32 * (q % 4));
        codes = _mm256_and_si256(q < 4 ? nib : _mm256_srli_epi16(nib, 4), low4);
        if constexpr (five)  // 16-bit shifts: the mask keeps the byte's own bit
          codes = _mm256_or_si256(codes, _mm256_and_si256(q < 4 ? _mm256_slli_epi16(high, 4 - q)
                                                                 : _mm256_srli_epi16(high, q - 4), bit4));
      }
#ifdef STRATA_VNNI
      const __m256i u = eight ? _mm256_xor_si256(codes, _mm256_set1_epi8(char(0x80))) : codes;
#else
      const __m256i u = eight ? _mm256_sign_epi8(codes, codes) : codes;  // |q| as unsigned: -128 too
#endif
      for (int r = 0; r < R; ++r) {
        const int8_t* at = xq + r * row * K + chunk * c + 4 * q;
        const __m256i x = quad_of(at);
#ifdef STRATA_VNNI
        sum[r][q % chains] = _mm256_dpbusd_epi32(sum[r][q % chains], u, x);
        if constexpr (fine) low[r] = _mm256_dpbusd_epi32(low[r], quad_of(at + 32), codes);
#else
        const __m256i pairs = _mm256_maddubs_epi16(u, eight ? _mm256_sign_epi8(x, codes) : x);
        if constexpr (eight) {
          wide[r] = _mm256_add_epi32(wide[r], _mm256_madd_epi16(pairs, ones));
        } else {
          sum[r] = _mm256_add_epi16(sum[r], pairs);
          if (five && q == 3) {
            wide[r] = _mm256_madd_epi16(sum[r], ones);
            sum[r] = _mm256_setzero_si256();
          }
        }
        if constexpr (fine) {
          low[r] = _mm256_add_epi16(low[r], _mm256_maddubs_epi16(quad_of(at + 32), codes));
          if (q == 3) {
            low_wide[r] = _mm256_madd_epi16(low[r], ones);
            low[r] = _mm256_setzero_si256();
          }
        }
#endif
      }
    }
    const __m256 d = halves8(o);
    for (int r = 0; r < R; ++r) {
#ifdef STRATA_VNNI
      __m256i total = sum[r][0];
      if constexpr (chains == 2) total = _mm256_add_epi32(total, sum[r][1]);
      const __m256i lows = low[r];
#else
      __m256i total = eight ? wide[r] : _mm256_add_epi32(wide[r], _mm256_madd_epi16(sum[r], ones));
      const __m256i lows = _mm256_add_epi32(low_wide[r], _mm256_madd_epi16(low[r], ones));
#endif
      if constexpr (fine) total = _mm256_add_epi32(_mm256_slli_epi32(total, 8), lows);  // 256 sum(q xh) + sum(xl q)
      if constexpr (offset != 0) total = _mm256_sub_epi32(total, _mm256_set1_epi32(offset * sums[r * C + c]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_broadcast_ss(dx + r * C + c)), acc[r]);
      if constexpr (mins) part[r] = _mm256_fmadd_ps(halves8(o + 16), _mm256_broadcast_ss(xs + r * C + c), part[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, _mm256_add_ps(acc[r], part[r]));
}

// y's columns [n0, n1) of eight-row blocks: dot(R, group, r, out) gives out[8 i + k], activation
// row r + i times the group's weight row k (dot_q45_k_r8, dot_q6_k_r8, dot_q32_r8). A group cut by the range
// (a thread's share) is computed whole and its share kept, so a column's bits never depend on
// how the columns were split.
template <typename Dot>
inline void groups_r8(const uint8_t* src, int64_t rb, int64_t n0, int64_t n1, int64_t M, int64_t N, float* y, Dot dot) {
  for (int64_t g = n0 / 8 * 8; g < n1; g += 8) {
    const uint8_t* group = src + g * rb;  // eight rows of rb bytes: the group's
    float out[4 * 8];
    in_blocks<4>(M, [&](auto R, int64_t r) {
      dot(R, group, r, out);
      for (int i = 0; i < R; ++i)
        for (int64_t k = 0; k < 8; ++k)
          if (g + k >= n0 && g + k < n1) y[(r + i) * N + g + k] = out[8 * i + k];
    });
  }
}

// Q6_K: f(k, codes) for the 8 chunks of 32 weights of the super-block at b, k as a compile-time
// constant, codes each weight's unsigned 6 bits (0-63) in a byte: 4 low bits from ql's nibbles
// (chunks 0-1 of a 128-weight half the low nibbles, 2-3 the high), 2 high bits from qh.
template <typename F>
inline void q6_k_chunks(const uint8_t* b, F&& f) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  auto half = [&](auto H) {
    constexpr int h = decltype(H)::value;
    const __m256i a = load(b + 64 * h), c = load(b + 64 * h + 32), qh = load(b + 128 + 32 * h);
    auto chunk = [&](auto J) {
      constexpr int j = decltype(J)::value;
      const __m256i src = j % 2 ? c : a;
      const __m256i lo = _mm256_and_si256(j < 2 ? src : _mm256_srli_epi16(src, 4), low4);
      __m256i hb;
      if constexpr (j == 0) hb = _mm256_slli_epi16(qh, 4);
      else if constexpr (j == 1) hb = _mm256_slli_epi16(qh, 2);
      else if constexpr (j == 2) hb = qh;
      else hb = _mm256_srli_epi16(qh, 2);
      f(std::integral_constant<int, 4 * h + j>{}, _mm256_or_si256(lo, _mm256_and_si256(hb, top2)));
    };
    chunk(std::integral_constant<int, 0>{});
    chunk(std::integral_constant<int, 1>{});
    chunk(std::integral_constant<int, 2>{});
    chunk(std::integral_constant<int, 3>{});
  };
  half(std::integral_constant<int, 0>{});
  half(std::integral_constant<int, 1>{});
}

// x16: rows [K/16] of dx * (each 16's sum of xq), for Q6_K's -32.
template <int R>
inline void dot_q6_k(const uint8_t* row, const int8_t* xq, const float* dx, const float* x16, int64_t K, float* out) {
  const int64_t C = K / 32, G = K / 16;
  __m256 acc[R], sb[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* b = row + i * 210;
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const float d = f16(b + 208);
    // the offset: -32 * d * sc per 16 (exact in float32) times dx * sum(xq) of the 16
    const __m256 off = _mm256_set1_ps(-32.0f * d);
    const __m256 off_lo = _mm256_mul_ps(off, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8)));
    const __m256 off_hi = _mm256_mul_ps(off, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8))));
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x16 + r * G + 16 * i), off_lo, acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x16 + r * G + 16 * i + 8), off_hi, acc[r]);
    }
    // the scales as int16, 0-7 in both halves of one register, 8-15 of another: chunk k's pair
    // (2k to the low 128 bits, 2k + 1 to the high) is one shuffle of one of them
    const __m256i sc16[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8)),
                             _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)))};
    const int8_t* x = xq + 256 * i;
    const float* dc = dx + 8 * i;
    q6_k_chunks(b, [&](auto At, __m256i w) {
      constexpr int k = decltype(At)::value;
      constexpr short lo_pair = short(0x0100 + 0x0404 * (k % 4)), hi_pair = short(lo_pair + 0x0202);
      const __m256i s = _mm256_shuffle_epi8(sc16[k / 4], _mm256_setr_epi16(lo_pair, lo_pair, lo_pair, lo_pair, lo_pair, lo_pair, lo_pair, lo_pair,
                                                                           hi_pair, hi_pair, hi_pair, hi_pair, hi_pair, hi_pair, hi_pair, hi_pair));
      chunk_int8<R, k == 0>(w, s, x + 32 * k, dc + k, K, C, sb);
    });
    const __m256 scale = _mm256_set1_ps(d);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(sb[r], scale, acc[r]);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// Fused 32-weight dots (AVX2, int8 activations): Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (Q5_0 and Q8_0:
// the layers and head parts of small models' Q4_K_M files, whose columns take no 256-weight
// blocks) straight from each block's bytes, no codes buffer: the block's codes made in a register
// (codes_q32, above), then per activation row the codes
// path's own operations (dot_int8: q unsigned as it is for the types with a minimum, Q8_0's |q|
// `maddubs` xq with q's sign, `madd`, one conversion, one fma by d * dx; the minimums m * xs as
// min_bias sums them), so Q4_1, Q5_1 and Q8_0 give the AVX2 codes path's bits (checked against
// the parent commit's build: 1-11 rows). Q4_0's -8 and Q5_0's -16 are taken as such a minimum
// too (-8 d, -16 d per block, exact), not subtracted from each code: no sign per activation,
// ~10 % at 4-8 rows (as fast as Q4_1 then), the same integers, a different float rounding than
// the codes path's (within float32's, tested). Up to eight rows share each block's unpacking.

// xs8: the types with a minimum, the rows' chunk sums of x eight rows a chunk (row r in lane r,
// see eights_by_chunk): min_bias's products and sums for all rows in one lane each.
template <int R, int T>
inline void dot_q32(const uint8_t* row, const int8_t* xq, const float* dx, const float* xs8, int64_t K, float* out) {
  // unsigned codes and an offset per block: Q4_1/Q5_1's minimum, Q4_0/Q5_0's -8 d / -16 d
  constexpr bool mins = T != Q8_0;
  constexpr int bytes = T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 34;
  const int64_t C = K / 32;
  __m256 acc[R];
  __m256 bias = _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* b = row + c * bytes;
    if constexpr (mins) {  // min_bias's sum, the same operations in each row's lane
      const float m = T == Q4_0 ? -8.0f * f16(b) : T == Q5_0 ? -16.0f * f16(b) : f16(b + 2);  // exact
      __m256 p = _mm256_mul_ps(_mm256_set1_ps(m), _mm256_loadu_ps(xs8 + 8 * c));
      asm("" : "+x"(p));  // no fma: min_bias's product is rounded before its sum
      bias = _mm256_add_ps(bias, p);
    }
    const __m256i w = codes_q32<T>(b);
    const __m256i magnitude = mins ? w : _mm256_sign_epi8(w, w);  // |w| as unsigned: -128 too
    const __m256 scale = _mm256_set1_ps(f16(b));
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + 32 * c));
      const __m256 sums = _mm256_cvtepi32_ps(sums_of_four(magnitude, mins ? x : _mm256_sign_epi8(x, w)));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, _mm256_broadcast_ss(dx + r * C + c)), acc[r]);
    }
  }
  alignas(32) float sums[8];
  _mm256_store_ps(sums, bias);
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + sums[r];
}

// Fused IQ4_XS and IQ3_S dots (AVX2, int8 activations): each chunk's signed codes made in a
// register (iq4_xs_codes, iq3_s_codes: the codes path's integers) and then dot_int8's own
// operations in its order (|q| times xq with q's sign, one conversion, one fma by the chunk's
// d * scale * dx; no minimum): the codes path's bits, without its row of codes written and read
// again. Up to eight rows share each chunk's codes.
template <int R, int T>
inline void dot_iq(const uint8_t* row, const int8_t* xq, const float* dx, int64_t K, const int8_t* kvalues,
                   const uint8_t* grid, float* out) {
  constexpr int bytes = T == IQ4_XS ? 136 : 110;
  const int64_t C = K / 32;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* b = row + i * bytes;
    const float d = f16(b);
    for (int k = 0; k < 8; ++k) {
      const int64_t c = 8 * i + k;
      // |q| and q's sign (IQ3_S: its grid's value and its sign bit as +-1)
      __m256i magnitude, sign;
      if constexpr (T == IQ4_XS) {
        sign = iq4_xs_codes(b, k, kvalues);
        magnitude = _mm256_sign_epi8(sign, sign);
      } else {
        magnitude = iq3_s_grid(b, k, grid);
        sign = _mm256_or_si256(iq3_s_negative(b, k), _mm256_set1_epi8(1));
      }
      const __m256 scale = _mm256_set1_ps(d * float(T == IQ4_XS ? iq4_xs_scale(b, k) : iq3_s_scale(b, k)));
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + 32 * c));
        const __m256 sums = _mm256_cvtepi32_ps(sums_of_four(magnitude, _mm256_sign_epi8(x, sign)));
        acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, _mm256_broadcast_ss(dx + r * C + c)), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + 0.0f;  // dot_int8's + bias (0: no minimum)
}

// xs [M, C] -> [ceil(M / 8), C, 8]: eight rows' sums of each chunk side by side (rows past M 0).
inline float* eights_by_chunk(const float* xs, int64_t M, int64_t C) {
  const int64_t groups = (M + 7) / 8;
  float* xs8 = static_cast<float*>(std::malloc(sizeof(float) * (groups * C * 8 > 0 ? groups * C * 8 : 1)));
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < 8; ++j) xs8[(g * C + c) * 8 + j] = 8 * g + j < M ? xs[(8 * g + j) * C + c] : 0.0f;
  return xs8;
}

// Fused float32-activation dots (AVX2; the head, `int8_x=False`): Q6_K and Q8_0 (the vocabulary
// heads of Q4_K_M files and of the others) straight from the packed bytes. Each 32 weights' codes
// are made in a register (codes_avx2's integers: Q6_K's 6 bits minus 32, Q8_0's bytes), widened
// to float32 as dot_float does, and then dot_float's own operations per row in its order (the
// products of each 16 summed in two fmas per 8 lanes, times the scale per 16 by fma into the
// lanes' sums, the same horizontal sum, + 0 for no minimum): the AVX2 codes path's bits, so the
// head's logits stay the float32 products of the exact weights (engine.md "exact head"; tested
// against an emulation of dot_float and against the parent's build). Rows four at a time, as
// dot_float.
inline void floats_of(__m256i w, __m256 f[4]) {  // 32 int8 codes -> 4 x 8 floats, exactly
  const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
  f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
  f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

template <int R>  // dot_float's per-chunk operations: x rows [K] from the chunk's first weight
inline void chunk_float(const __m256 f[4], __m256 lo_scale, __m256 hi_scale, const float* x, int64_t K, __m256* acc) {
  for (int r = 0; r < R; ++r) {
    const float* v = x + r * K;
    const __m256 lo = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(v + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(v)));
    const __m256 hi = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(v + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(v + 16)));
    acc[r] = _mm256_fmadd_ps(lo, lo_scale, acc[r]);
    acc[r] = _mm256_fmadd_ps(hi, hi_scale, acc[r]);
  }
}

template <int R>
inline void dot_q8_0_float(const uint8_t* row, const float* x, int64_t K, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / 32; ++c) {
    const uint8_t* b = row + 34 * c;
    __m256 f[4];
    floats_of(load(b + 2), f);
    const __m256 d = _mm256_set1_ps(f16(b));
    chunk_float<R>(f, d, d, x + 32 * c, K, acc);
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + 0.0f;  // dot_float's + bias (0: no minimum)
}

template <int R>
inline void dot_q6_k_float(const uint8_t* row, const float* x, int64_t K, float* out) {
  const __m256i bias = _mm256_set1_epi8(32);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* b = row + i * 210;
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    const __m256 d = _mm256_set1_ps(f16(b + 208));
    alignas(32) float s[16];  // d * sc per 16, codes_avx2's products
    _mm256_store_ps(s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))));
    _mm256_store_ps(s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc8, sc8)))));
    const float* v = x + 256 * i;
    q6_k_chunks(b, [&](auto At, __m256i w) {
      constexpr int k = decltype(At)::value;
      __m256 f[4];
      floats_of(_mm256_sub_epi8(w, bias), f);
      chunk_float<R>(f, _mm256_broadcast_ss(s + 2 * k), _mm256_broadcast_ss(s + 2 * k + 1), v + 32 * k, K, acc);
    });
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + 0.0f;
}

// Q4_K / Q5_K: the unsigned codes (nibbles, Q5_K's high bit << 4), d * sc per 32 for both
// halves, and the minimums' share as min_bias sums it (-(dmin * m) times each chunk's sum of x,
// product rounded, then added, chunk after chunk), added after the horizontal sum.
template <int R, bool Five>
inline void dot_q45_k_float(const uint8_t* row, const float* x, const float* xs, int64_t K, float* out) {
  constexpr int bytes = Five ? 176 : 144;
  const int64_t C = K / 32;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  float bias[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), bias[r] = 0.0f;
  for (int64_t i = 0; i < K / 256; ++i) {
    const uint8_t* b = row + i * bytes;
    const float d = f16(b), dmin = f16(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k(b + 4, sc, mn);
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < 8; ++k) {
        float p = -(dmin * float(mn[k])) * xs[r * C + 8 * i + k];
        asm("" : "+x"(p));  // no fma: min_bias's product is rounded before its sum
        bias[r] += p;
      }
    const uint8_t* qs = b + (Five ? 48 : 16);
    const __m256i qh = Five ? load(b + 16) : _mm256_setzero_si256();
    const float* v = x + 256 * i;
    for (int j = 0; j < 4; ++j) {
      const __m256i q = load(qs + 32 * j);
      __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
      if constexpr (Five) {
        const __m256i one = _mm256_set1_epi8(1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
      }
      __m256 f[4];
      floats_of(lo, f);
      const __m256 s_lo = _mm256_set1_ps(d * float(sc[2 * j])), s_hi = _mm256_set1_ps(d * float(sc[2 * j + 1]));
      chunk_float<R>(f, s_lo, s_lo, v + 64 * j, K, acc);
      floats_of(hi, f);
      chunk_float<R>(f, s_hi, s_hi, v + 64 * j + 32, K, acc);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + bias[r];
}

inline bool fused_float(int qtype) { return qtype == Q6_K || qtype == Q8_0 || qtype == Q4_K || qtype == Q5_K; }

__attribute__((noinline)) void fused_float_rows(int qtype, const uint8_t* src, int64_t rb, int64_t K, int64_t n0,
                                                int64_t n1, int64_t M, int64_t N, const float* x, const float* xs,
                                                float* y) {
  const int64_t C = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = src + n * rb;
    in_rows<4>(M, N, n, y, [&](auto R, int64_t r, float* out) {
      if (qtype == Q8_0) dot_q8_0_float<R>(row, x + r * K, K, out);
      else if (qtype == Q4_K) dot_q45_k_float<R, false>(row, x + r * K, xs + r * C, K, out);
      else if (qtype == Q5_K) dot_q45_k_float<R, true>(row, x + r * K, xs + r * C, K, out);
      else dot_q6_k_float<R>(row, x + r * K, K, out);
    });
  }
}

// strata_mm_rows for those (int8 activations): its own function, so that the codes path's loop
// keeps its inlining (codes_avx2 out of line costs the 32-weight types 3-4x)
__attribute__((noinline)) void fused_rows(int qtype, const uint8_t* src, int64_t rb, int64_t K, int64_t n0, int64_t n1,
                                          int64_t M, int64_t N, const int8_t* xq, const float* dx, const float* xs,
                                          const int8_t* kvalues, const uint8_t* grid, float* y) {
  const int64_t C = K / 32, G = K / 16;
  if (is_32(qtype - EIGHT_ROWS)) {  // Q4_0_R8 .. Q8_0_R8: each block's sum(xq) as an integer
    const bool fine = takes_x16(qtype);  // Q4_1_R8: x16's, from its high and low bytes
    int32_t* sums = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * (M * C > 0 ? M * C : 1)));
    for (int64_t b = 0; b < M * C; ++b) sums[b] = group_sum(xq, b, 32, fine);
    groups_r8(src, rb, n0, n1, M, N, y, [&](auto R, const uint8_t* g, int64_t r, float* out) {
      const int8_t* x = xq + r * (fine ? 2 : 1) * K;
      switch (qtype - EIGHT_ROWS) {
        case Q4_0: dot_q32_r8<R, Q4_0>(g, x, dx + r * C, xs + r * C, sums + r * C, K, out); break;
        case Q4_1: dot_q32_r8<R, Q4_1>(g, x, dx + r * C, xs + r * C, sums + r * C, K, out); break;
        case Q5_0: dot_q32_r8<R, Q5_0>(g, x, dx + r * C, xs + r * C, sums + r * C, K, out); break;
        case Q5_1: dot_q32_r8<R, Q5_1>(g, x, dx + r * C, xs + r * C, sums + r * C, K, out); break;
        default: dot_q32_r8<R, Q8_0>(g, x, dx + r * C, xs + r * C, sums + r * C, K, out); break;
      }
    });
    std::free(sums);
    return;
  }
  if (qtype == Q4_K_R8 || qtype == Q5_K_R8)
    return groups_r8(src, rb, n0, n1, M, N, y, [&](auto R, const uint8_t* g, int64_t r, float* out) {
      if (qtype == Q5_K_R8) dot_q45_k_r8<R, true>(g, xq + r * K, dx + r * C, xs + r * C, K, out);
      else dot_q45_k_r8<R, false>(g, xq + r * K, dx + r * C, xs + r * C, K, out);
    });
  float* x16 = nullptr;
  if (qtype == Q6_K || qtype == Q6_K_R8) {  // dx * (each 16's sum of xq), M * K / 16 floats
    x16 = static_cast<float*>(std::malloc(sizeof(float) * (M * G > 0 ? M * G : 1)));
    for (int64_t g = 0; g < M * G; ++g) x16[g] = dx[g / 2] * float(group_sum(xq, g, 16, false));
  }
  if (qtype == Q6_K_R8) {
    groups_r8(src, rb, n0, n1, M, N, y, [&](auto R, const uint8_t* g, int64_t r, float* out) {
      dot_q6_k_r8<R>(g, xq + r * K, dx + r * C, x16 + r * G, K, out);
    });
    std::free(x16);
    return;
  }
  float* xs8 = is_32(qtype) && qtype != Q8_0 ? eights_by_chunk(xs, M, C) : nullptr;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = src + n * rb;
    in_rows<8>(M, N, n, y, [&](auto R, int64_t r, float* out) {
      const int8_t* x = xq + r * K;
      const float* sums8 = xs8 ? xs8 + r * C : nullptr;  // r is a multiple of 8: its group's [C, 8]
      if (qtype == Q4_0) dot_q32<R, Q4_0>(row, x, dx + r * C, sums8, K, out);
      else if (qtype == Q4_1) dot_q32<R, Q4_1>(row, x, dx + r * C, sums8, K, out);
      else if (qtype == Q5_0) dot_q32<R, Q5_0>(row, x, dx + r * C, sums8, K, out);
      else if (qtype == Q5_1) dot_q32<R, Q5_1>(row, x, dx + r * C, sums8, K, out);
      else if (qtype == Q8_0) dot_q32<R, Q8_0>(row, x, dx + r * C, nullptr, K, out);
      else if (qtype == Q4_K) dot_q45_k<R, false>(row, xq + r * K, dx + r * C, xs + r * C, K, out);
      else if (qtype == Q5_K) dot_q45_k<R, true>(row, xq + r * K, dx + r * C, xs + r * C, K, out);
      else if (qtype == IQ4_XS) dot_iq<R, IQ4_XS>(row, x, dx + r * C, K, kvalues, grid, out);
      else if (qtype == IQ3_S) dot_iq<R, IQ3_S>(row, x, dx + r * C, K, kvalues, grid, out);
      else dot_q6_k<R>(row, xq + r * K, dx + r * C, x16 + r * G, K, out);
    });
  }
  std::free(x16);
  std::free(xs8);
}
#endif

}  // namespace

extern "C" int strata_block_weights(int qtype);  // dequant.cpp
extern "C" int strata_block_bytes(int qtype);
extern "C" int strata_code_offset(int qtype);
void strata_dequant_row(int qtype, const uint8_t* src, float* y, int64_t cols, const float* table);

namespace {

// Per 32 of x rows [M, K] float32: dx = max|x| / Top, q = x * (Top / max|x|) rounded to nearest
// (even), put(chunk, e, q), xs = dx * sum(q); the same arithmetic in every build.
template <int Top, typename Put>
inline void quantize_per_32(const float* x, int64_t M, int64_t K, float* dx, float* xs, Put put) {
  for (int64_t r = 0; r < M * K / 32; ++r) {
    const float* v = x + 32 * r;
    float amax = 0.0f;
    for (int e = 0; e < 32; ++e) amax = amax > __builtin_fabsf(v[e]) ? amax : __builtin_fabsf(v[e]);
    const float inv = amax > 0.0f ? float(Top) / amax : 0.0f;
    int32_t sum = 0;
    for (int e = 0; e < 32; ++e) {
      const int32_t q = int32_t(__builtin_nearbyintf(v[e] * inv));
      put(r, e, q);
      sum += q;
    }
    dx[r] = amax / float(Top);
    xs[r] = dx[r] * float(sum);
  }
}

}  // namespace

extern "C" {

// x rows [M, K] float32 -> xq [M, K] int8, dx [M, K/32] (x ~ dx * xq), xs [M, K/32] (dx * sum xq).
void ENTRY(strata_quantize_x)(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  quantize_per_32<127>(x, M, K, dx, xs, [&](int64_t r, int e, int32_t q) { xq[32 * r + e] = int8_t(q); });
}

// The same to 16 bits, x16 in [-32767, 32767], for the repacked Q4_1 dots (dot_q32_r8):
// xq [M, 2K], each chunk's 64 bytes its high bytes (x16 >> 8, signed) then its low ones (x16 & 255).
void ENTRY(strata_quantize_x16)(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* xs) {
  quantize_per_32<32767>(x, M, K, dx, xs, [&](int64_t r, int e, int32_t q) {
    xq[64 * r + e] = int8_t(q >> 8);
    xq[64 * r + 32 + e] = int8_t(uint8_t(q & 255));
  });
}

}  // extern "C"

namespace {

// float32 -> bf16 as torch's `.to(torch.bfloat16)` rounds a tensor (its vectorized conversion):
// to nearest, ties to even, any NaN to 0xFFFF (a broken file's NaN scale); -0.0, subnormals and
// infinities kept.
inline uint16_t bf16_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (f != f) return 0xFFFF;
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef STRATA_AVX2
// 16 finite floats (a, then b) -> bf16_of each: the high half of bits + 0x7FFF + its lowest bit.
inline void store_bf16(uint16_t* out, __m256 a, __m256 b) {
  auto round = [](__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  };
  const __m256i packed = _mm256_packus_epi32(round(a), round(b));  // 128-bit lanes: a0-3 b0-3 | a4-7 b4-7
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xD8));
}
#endif

inline bool finite(const float* v, int n) {
  for (int i = 0; i < n; ++i)
    if (!__builtin_isfinite(v[i])) return false;
  return true;
}

// strata_unpack_rows's work (below), into float32 (T float) or bf16 (T uint16_t) weights.
template <typename T>
void unpack_rows(int qtype, const uint8_t* src, int64_t rb, int64_t rows, int64_t k0, int64_t kc,
                 const int8_t* kvalues, const uint8_t* grid, const float* table, T* out) {
  const int bw = strata_block_weights(qtype), bb = strata_block_bytes(qtype);
#ifdef STRATA_AVX2
  alignas(32) int8_t q[256];
  float s[16], m[8];
  const bool mins = has_min(qtype);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * rb + k0 / bw * bb;
    for (int64_t i = 0; i < kc / bw; ++i) {
      codes_avx2(qtype, row + i * bb, Codes{q, s, m}, kvalues, grid);
      T* w = out + r * kc + i * bw;
      auto weights = [&](int e) {  // weights e.. e + 7
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + e))));
        const __m256 sv = _mm256_set1_ps(s[e / 16]);  // no + 0.0 where there is no minimum: gguf's -0.0 stays
        return mins ? _mm256_fmadd_ps(v, sv, _mm256_set1_ps(m[e / 32])) : _mm256_mul_ps(v, sv);
      };
      if constexpr (std::is_same_v<T, float>) {
        for (int e = 0; e < bw; e += 8) _mm256_storeu_ps(w + e, weights(e));
      } else if (finite(s, bw / 16) && finite(m, bw / 32)) {  // then so is every weight: no NaN to test
        for (int e = 0; e < bw; e += 16) store_bf16(w + e, weights(e), weights(e + 8));
      } else {  // a broken file's NaN or inf scale
        alignas(32) float y[8];
        for (int e = 0; e < bw; e += 8) {
          _mm256_store_ps(y, weights(e));
          for (int j = 0; j < 8; ++j) w[e + j] = bf16_of(y[j]);
        }
      }
    }
  }
#else
  (void)kvalues, (void)grid, (void)bw, (void)bb;
  std::vector<float> line(std::is_same_v<T, float> ? 0 : kc);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * rb + k0 / bw * bb;
    if constexpr (std::is_same_v<T, float>) {
      strata_dequant_row(qtype, row, out + r * kc, kc, table);
    } else {
      strata_dequant_row(qtype, row, line.data(), kc, table);
      for (int64_t e = 0; e < kc; ++e) out[r * kc + e] = bf16_of(line[e]);
    }
  }
#endif
}

}  // namespace

extern "C" {

// `rows` rows of a matrix (rb bytes apart in src), weights [k0, k0 + kc) of each (whole blocks)
// -> out [rows][kc] float32, bit for bit gguf's dequantize (dequant.cpp's values): on AVX2 from
// the codes, s * q + m in one rounding, which is gguf's, since s * q is exact wherever m is not
// zero (an f16 scale times a 6-bit integer times a code of at most 5 bits), and where m is zero
// (Q6_K, Q8_0, Q4_0, Q5_0, the IQ types) s * q, rounded once as gguf's. The baseline
// build unpacks with dequant.cpp row by row.
void ENTRY(strata_unpack_rows)(int qtype, const uint8_t* src, int64_t rb, int64_t rows, int64_t k0, int64_t kc,
                               const int8_t* kvalues, const uint8_t* grid, const float* table, float* out) {
  unpack_rows(qtype, src, rb, rows, k0, kc, kvalues, grid, table, out);
}

// The same rounded to bf16 as torch rounds those floats (a prompt's slabs where oneDNN multiplies
// in bf16): one pass, no float32 slab written and read again.
void ENTRY(strata_unpack_rows_bf16)(int qtype, const uint8_t* src, int64_t rb, int64_t rows, int64_t k0,
                                    int64_t kc, const int8_t* kvalues, const uint8_t* grid, const float* table,
                                    uint16_t* out) {
  unpack_rows(qtype, src, rb, rows, k0, kc, kvalues, grid, table, out);
}

#ifdef STRATA_AVX2
// `rows` (<= 16) rows of a matrix (rb bytes apart in src), weights [k0, k0 + kc) of each (whole
// blocks) -> a panel of prompt_int8.cpp's product (its AVX2 and VNNI builds'): codes [kc/4][16][4] unsigned bytes q + the
// type's offset (row j's four weights 4i..4i+3 at codes[64 i + 4 j]), scales [kc/16][16],
// minimums [kc/32][16]; rows past `rows` all zero (their outputs are never stored).
void ENTRY(strata_pack_codes)(int qtype, const uint8_t* src, int64_t rb, int rows, int64_t k0, int64_t kc,
                              const int8_t* kvalues, const uint8_t* grid, uint8_t* codes, float* s, float* m) {
  const int bw = strata_block_weights(qtype), bb = strata_block_bytes(qtype);
  const uint8_t offset = uint8_t(strata_code_offset(qtype));
  alignas(32) int8_t q[256];
  float bs[16], bm[8];
  std::memset(codes, 0, size_t(kc) * 16);
  std::memset(s, 0, sizeof(float) * size_t(kc / 16) * 16);
  std::memset(m, 0, sizeof(float) * size_t(kc / 32) * 16);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = src + r * rb + k0 / bw * bb;
    for (int64_t i = 0; i < kc / bw; ++i) {
      codes_avx2(qtype, row + i * bb, Codes{q, bs, bm}, kvalues, grid);
      const int64_t e0 = i * bw;
      alignas(32) uint8_t u[256];  // the block's codes + offset (bytes wrap: every code + offset is in 0..255)
      for (int e = 0; e < bw; e += 32)
        _mm256_store_si256(reinterpret_cast<__m256i*>(u + e),
                           _mm256_add_epi8(load(reinterpret_cast<const uint8_t*>(q + e)), _mm256_set1_epi8(char(offset))));
      for (int e = 0; e < bw; e += 4) std::memcpy(codes + 16 * (e0 + e) + 4 * r, u + e, 4);  // 64 bytes per 4 weights
      for (int g = 0; g < bw / 16; ++g) s[16 * (e0 / 16 + g) + r] = bs[g];
      for (int g = 0; g < bw / 32; ++g) m[16 * (e0 / 32 + g) + r] = bm[g];
    }
  }
}
#endif

// Rows [n0, n1) of y [M, N] (row stride N) = x @ W^T with W's rows rb bytes apart in src.
// work: K bytes + K/16 + K/32 floats of scratch. int8 activations when xq is set (dx, xs from
// strata_quantize_x), else float32 x with xs each chunk's sum of x.
void ENTRY(strata_mm_rows)(int qtype, const uint8_t* src, int64_t rb, int64_t K, int64_t n0, int64_t n1,
                           int64_t M, int64_t N, const float* x, const int8_t* xq, const float* dx,
                           const float* xs, const int8_t* kvalues, const uint8_t* grid, float* y,
                           void* work) {
  int8_t* q = static_cast<int8_t*>(work);
  float* s = reinterpret_cast<float*>(q + K);
  float* m = s + K / 16;
  const bool small = is_32(qtype), mins = has_min(qtype);
  const int bw = strata_block_weights(qtype), bb = strata_block_bytes(qtype);
#ifdef STRATA_AVX2
  if (xq) return fused_rows(qtype, src, rb, K, n0, n1, M, N, xq, dx, xs, kvalues, grid, y);
  if (!xq && fused_float(qtype)) return fused_float_rows(qtype, src, rb, K, n0, n1, M, N, x, xs, y);
#endif
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = src + n * rb;
    for (int64_t i = 0; i < K / bw; ++i) {
      const Codes c{q + i * bw, s + i * bw / 16, m + i * bw / 32};
#ifdef STRATA_AVX2
      codes_avx2(qtype, row + i * bb, c, kvalues, grid);
      continue;
#endif
      if (small)
        codes_32(qtype, row + i * bb, c);
      else
        codes_256(qtype, row + i * bb, c, kvalues, grid);
    }
    const int64_t C = K / 32;
    if (!xq)
      in_rows<4>(M, N, n, y, [&](auto R, int64_t r, float* out) {
        dot_float<R>(q, s, m, mins, x + r * K, xs + r * C, K, out);
      });
    else
      in_rows<4>(M, N, n, y, [&](auto R, int64_t r, float* out) {
        dot_int8<R>(q, s, m, mins, xq + r * K, dx + r * C, xs + r * C, K, out);
      });
  }
}

}  // extern "C"
