// One row of a GGUF-quantized matrix (whole blocks) -> float32, bit for bit what gguf's Python
// dequantize computes: the same float32 products and sums, one operation at a time. Built with
// -ffp-contract=off so no product and sum are fused into one rounding (that would differ from
// numpy). No torch here: ops.cpp calls this for each row it multiplies or looks up.
//
// Block layouts and formulas follow gguf-py's gguf/quants.py (the format's reference reader);
// the codebooks (IQ4_XS's 16 values, IQ3_S's 512-entry grid) are passed in from gguf-py's own
// tables at run time, not copied here.
#include "layouts.h"

namespace {

#define INLINE static inline __attribute__((always_inline))

// Q8_0: f16 d, 32 x int8; w = q * d.
INLINE void q8_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int l = 0; l < 32; ++l) y[l] = float(q[l]) * d;
}

// Q4_0: f16 d, 16 bytes (element l low nibble of byte l, l+16 its high nibble); w = d * (q - 8).
INLINE void q4_0(const uint8_t* b, float* y) {
  const float d = f16(b);
  const uint8_t* qs = b + 2;
  for (int l = 0; l < 16; ++l) {
    y[l] = d * float(int(qs[l] & 0x0F) - 8);
    y[l + 16] = d * float(int(qs[l] >> 4) - 8);
  }
}

// Q4_1: f16 d, f16 m, 16 bytes; w = d * q + m.
INLINE void q4_1(const uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const uint8_t* qs = b + 4;
  for (int l = 0; l < 16; ++l) {
    y[l] = d * float(qs[l] & 0x0F) + m;
    y[l + 16] = d * float(qs[l] >> 4) + m;
  }
}

// Q5_0: f16 d, uint32 qh (bit l: element l's fifth bit), 16 bytes as Q4_0; w = d * (q - 16).
// Q5_1: f16 d, f16 m, qh, 16 bytes; w = d * q + m.
INLINE void q5(const uint8_t* b, float* y, bool with_min) {
  const float d = f16(b), m = with_min ? f16(b + 2) : 0.0f;
  const uint8_t* p = b + (with_min ? 4 : 2);
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const uint8_t* qs = p + 4;
  for (int l = 0; l < 16; ++l) {
    int lo = (qs[l] & 0x0F) | (((qh >> l) & 1) << 4);
    int hi = (qs[l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
    if (with_min) {
      y[l] = d * float(lo) + m;
      y[l + 16] = d * float(hi) + m;
    } else {
      y[l] = d * float(lo - 16);
      y[l + 16] = d * float(hi - 16);
    }
  }
}

// Q4_K (256 weights): f16 d, f16 dmin, 12 scale bytes, 128 bytes: sub-block s (32 weights) is
// the low (s even) or high (s odd) nibbles of bytes 32*(s/2)...; w = (d*sc) * q - (dmin*m).
// Q5_K: the same plus 32 bytes qh after the scales (bit s of qh[l]: weight l of sub-block s).
INLINE void qk45(const uint8_t* b, float* y, bool five) {
  const float d = f16(b), dmin = f16(b + 2);
  uint8_t sc[8], mn[8];
  scale_min_k(b + 4, sc, mn);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int s = 0; s < 8; ++s) {
    const float ds = d * float(sc[s]), dm = dmin * float(mn[s]);
    const uint8_t* q = qs + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    for (int l = 0; l < 32; ++l) {
      int v = (q[l] >> shift) & 0x0F;
      if (five) v |= ((qh[l] >> s) & 1) << 4;
      y[32 * s + l] = ds * float(v) - dm;
    }
  }
}

// Q6_K (256): 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d. Half h (128 weights), group j
// (32): low 4 bits from ql[64h + 32(j%2) + l] (nibble j/2), top 2 from qh[32h + l] >> 2j;
// w = (d * scale[e/16]) * (q - 32).
INLINE void q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  float ds[16];
  for (int i = 0; i < 16; ++i) ds[i] = d * float(scales[i]);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j) {
      const uint8_t* lo = ql + 64 * h + 32 * (j % 2);
      const int shift = 4 * (j / 2);
      float* out = y + 128 * h + 32 * j;
      const float d0 = ds[(128 * h + 32 * j) / 16], d1 = ds[(128 * h + 32 * j) / 16 + 1];
      for (int l = 0; l < 32; ++l) {
        int v = ((lo[l] >> shift) & 0x0F) | (((qh[32 * h + l] >> (2 * j)) & 3) << 4);
        out[l] = (l < 16 ? d0 : d1) * float(v - 32);
      }
    }
}

// IQ4_XS (256): f16 d, uint16 scales_h, 4 bytes scales_l, 128 bytes; sub-block s: scale
// ((scales_l[s/2] >> 4(s%2)) & 15 | ((scales_h >> 2s) & 3) << 4) - 32, weight l of it the
// codebook value at nibble (l<16: low of byte 16s+l, else high of 16s+l-16); w = (d*scale)*value.
INLINE void iq4_xs(const uint8_t* b, float* y, const float* kvalues) {
  const float d = f16(b);
  uint16_t sh;
  std::memcpy(&sh, b + 2, 2);
  const uint8_t* sl = b + 4;
  const uint8_t* qs = b + 8;
  for (int s = 0; s < 8; ++s) {
    int scale = (((sl[s / 2] >> (4 * (s % 2))) & 0x0F) | (((sh >> (2 * s)) & 3) << 4)) - 32;
    const float dl = d * float(scale);
    const uint8_t* q = qs + 16 * s;
    for (int l = 0; l < 16; ++l) {
      y[32 * s + l] = dl * kvalues[q[l] & 0x0F];
      y[32 * s + l + 16] = dl * kvalues[q[l] >> 4];
    }
  }
}

// IQ3_S (256): f16 d, 64 bytes qs, 8 bytes qh, 32 bytes signs, 4 bytes scales. Grid index i
// (0..63) = qs[i] | bit i of qh << 8 names 4 weights; sub-block s (32 weights) has
// db = d * (1 + 2*scale_s); weight e = (db * grid[e]) * (bit e%8 of signs[e/8] ? -1 : 1).
INLINE void iq3_s(const uint8_t* b, float* y, const float* grid) {
  const float d = f16(b);
  const uint8_t* qs = b + 2;
  const uint8_t* qh = b + 66;
  const uint8_t* signs = b + 74;
  const uint8_t* scales = b + 106;
  for (int s = 0; s < 8; ++s) {
    const float db = d * float(1 + 2 * ((scales[s / 2] >> (4 * (s % 2))) & 0x0F));
    // one flat loop over the sub-block's 32 weights (index arithmetic only: vector gathers)
    const uint8_t* q = qs + 8 * s;
    const uint8_t* sg = signs + 4 * s;
    const int high = qh[s];
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2;
      const int index = (int(q[g]) | (((high >> g) & 1) << 8)) * 4 + (l & 3);
      const float sign = float(1 - 2 * ((sg[l >> 3] >> (l & 7)) & 1));
      y[32 * s + l] = db * grid[index] * sign;
    }
  }
}

}  // namespace

// layouts.h `takes_x16`, for ops.cpp
extern "C" bool strata_takes_x16(int qtype) { return takes_x16(qtype); }

// Block size (weights) and bytes of each type this file knows; 0 for any other.
extern "C" int strata_block_weights(int qtype) {
  switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_0_R8: case Q4_1_R8: case Q5_0_R8: case Q5_1_R8: case Q8_0_R8: return 32;
    case Q4_K: case Q5_K: case Q6_K: case IQ3_S: case IQ4_XS: case Q4_K_R8: case Q5_K_R8: case Q6_K_R8: return 256;
    default: return 0;
  }
}

extern "C" int strata_block_bytes(int qtype) {
  switch (qtype) {
    case Q4_0: return 18; case Q4_1: return 20; case Q5_0: return 22; case Q5_1: return 24;
    case Q8_0: return 34; case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    case IQ3_S: return 110; case IQ4_XS: return 136;
    case Q4_0_R8: return 18; case Q4_1_R8: return 20; case Q5_0_R8: return 22; case Q5_1_R8: return 24;
    case Q8_0_R8: return 34;  // the 32-weight types' groups: the file's bytes, moved (repack.cpp)
    case Q4_K_R8: return 148;  // a row's share of its group's 1184 (repack.cpp)
    case Q5_K_R8: return 180;  // of 1440: Q4_K_R8's and the high bits
    case Q6_K_R8: return 210;
    default: return 0;
  }
}

// What kernel.cpp's codes (exact integer weights, -128..127) are raised by to be unsigned bytes
// for prompt_int8.cpp's product: at least minus the type's smallest code.
extern "C" int strata_code_offset(int qtype) {
  switch (qtype) {
    case Q4_1: case Q5_1: case Q4_K: case Q5_K: return 0;  // 0..15 / 0..31, their minimums apart
    case Q4_0: return 8;
    case Q5_0: return 16;
    case Q6_K: return 32;
    default: return 128;  // Q8_0, and the codebook types' signed values
  }
}

// The largest of those unsigned bytes (prompt_int8.cpp's AVX2 sums: how many int16 can hold).
extern "C" int strata_code_top(int qtype) {
  switch (qtype) {
    case Q4_0: case Q4_1: case Q4_K: return 15;
    case Q5_0: case Q5_1: case Q5_K: return 31;
    case Q6_K: return 63;
    default: return 255;
  }
}

// cols weights (whole blocks) from src into y. table: IQ4_XS's 16 codebook values, IQ3_S's grid
// (512 x 4), unused otherwise.
__attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
void strata_dequant_row(int qtype, const uint8_t* src, float* y, int64_t cols, const float* table) {
  const int bw = strata_block_weights(qtype), bb = strata_block_bytes(qtype);
  const int64_t n = cols / bw;
  switch (qtype) {
    case Q8_0: for (int64_t i = 0; i < n; ++i) q8_0(src + i * bb, y + i * bw); break;
    case Q4_0: for (int64_t i = 0; i < n; ++i) q4_0(src + i * bb, y + i * bw); break;
    case Q4_1: for (int64_t i = 0; i < n; ++i) q4_1(src + i * bb, y + i * bw); break;
    case Q5_0: for (int64_t i = 0; i < n; ++i) q5(src + i * bb, y + i * bw, false); break;
    case Q5_1: for (int64_t i = 0; i < n; ++i) q5(src + i * bb, y + i * bw, true); break;
    case Q4_K: for (int64_t i = 0; i < n; ++i) qk45(src + i * bb, y + i * bw, false); break;
    case Q5_K: for (int64_t i = 0; i < n; ++i) qk45(src + i * bb, y + i * bw, true); break;
    case Q6_K: for (int64_t i = 0; i < n; ++i) q6_k(src + i * bb, y + i * bw); break;
    case IQ4_XS: for (int64_t i = 0; i < n; ++i) iq4_xs(src + i * bb, y + i * bw, table); break;
    case IQ3_S: for (int64_t i = 0; i < n; ++i) iq3_s(src + i * bb, y + i * bw, table); break;
    default: break;
  }
}
