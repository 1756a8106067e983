// What dequant.cpp and kernel.cpp both read off a GGUF block: the type numbers, the f16 scales
// and the K-quants' packed 6-bit sub-block scales (prompt.cpp takes ENTRY from here). Everything
// here has internal linkage (an anonymous namespace), so the two builds (AVX2 and baseline) of
// kernel.cpp and prompt.cpp each get their own copy and the linker never merges an AVX2-compiled
// function into the baseline build. STRATA_AVX2 (set for those files' AVX2 builds only) converts
// halves with F16C: the same exact conversion.
#pragma once
#include <cstdint>
#include <cstring>

#ifdef STRATA_AVX2
#include <immintrin.h>
#endif

// The name of an entry point of a file built more than once (kernel.cpp, prompt.cpp): its AVX-512
// BF16 build's (prompt_bf16.cpp alone), its AVX-512 VNNI build's (kernel.cpp, prompt_int8.cpp), its
// AVX2 build's or its baseline build's, so ops.cpp can link them all and pick one at run time.
#if defined(STRATA_BF16)
#define ENTRY(name) name##_bf16
#elif defined(STRATA_VNNI)
#define ENTRY(name) name##_vnni
#elif defined(STRATA_AVX2)
#define ENTRY(name) name##_avx2
#else
#define ENTRY(name) name##_portable
#endif

namespace {

enum QType : int {  // GGMLQuantizationType values
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  IQ3_S = 21, IQ4_XS = 23,
  // not GGUF types: the same blocks eight rows at a time (repack.cpp), the type + EIGHT_ROWS
  Q4_0_R8 = 1002, Q4_1_R8 = 1003, Q5_0_R8 = 1006, Q5_1_R8 = 1007, Q8_0_R8 = 1008,
  Q4_K_R8 = 1012, Q5_K_R8 = 1013, Q6_K_R8 = 1014,
  EIGHT_ROWS = 1000,
};

// The repacked types whose products take 16-bit activations (kernel.cpp dot_q32_r8 and
// strata_quantize_x16): Q4_1, the default file's type, which lost its precision test's margin
// with int8 ones. Q4_0 takes int8 ones since Dec 7 (seventh session), as every other type and
// llama.cpp do: twice the integer rate for a few near-ties (docs/engine.md, "The 32-weight types
// repacked").
constexpr bool takes_x16(int qtype) { return qtype == Q4_1_R8; }

// The integer sum of group g (G weights) of quantized activations xq: int8 codes, or (wide, G
// 32) kernel.cpp strata_quantize_x16's x16, each chunk's 64 bytes its high bytes then its low ones.
inline int32_t group_sum(const int8_t* xq, int64_t g, int G, bool wide) {
  int32_t sum = 0;
  if (wide)
    for (int e = 0; e < 32; ++e) sum += 256 * xq[64 * g + e] + int32_t(uint8_t(xq[64 * g + 32 + e]));
  else
    for (int e = 0; e < G; ++e) sum += xq[G * g + e];
  return sum;
}

inline float f16(const uint8_t* p) {  // IEEE half (little-endian) -> float, exactly
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef STRATA_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    float f = float(mant) * 5.9604644775390625e-8f;  // mant * 2^-24: exact
    return sign ? -f : f;
  }
  bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// K-quants' 12 bytes of 6-bit sub-block scales and mins (8 of each).
inline void scale_min_k(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
  }
}

// A MR x NR tile of y (rows ldy apart) by tile(c, ldc), which writes (or, accumulating, adds to)
// a whole MR x NR block at c: straight into y where the tile lies inside it, else through tmp
// (MR * NR floats), only y's own `rows` x `cols` elements read and copied back (prompt.cpp's and
// prompt_int8.cpp's panels: their last rows and columns).
template <int MR, int NR, typename Tile>
inline void tile_at_edge(float* c, int64_t ldy, int rows, int cols, bool accumulate, float* tmp, Tile tile) {
  if (rows == MR && cols == NR) return tile(c, ldy);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) tmp[i * NR + j] = accumulate && i < rows && j < cols ? c[i * ldy + j] : 0.0f;
  tile(tmp, int64_t(NR));
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < cols; ++j) c[i * ldy + j] = tmp[i * NR + j];
}

}  // namespace
