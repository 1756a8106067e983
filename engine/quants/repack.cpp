// Q4_K repacked eight weight rows at a time (`Q4_K_R8`), so that the decode step's dot
// (kernel.cpp `dot_r8`) holds one weight row per lane of a register: a chunk's float work (its
// integer sum converted, times d * sc * dx, the minimum times the chunk's sum) is one operation
// for eight rows, with no horizontal sums, and its scales are bytes ready to widen.
//
// An exact repacking: every bit of the file's blocks is kept, moved. Per group of eight rows and
// super-block (256 weights), 1184 bytes (8 x 148 against the file's 8 x 144), in the order the
// dot reads them:
//   [0, 16)      the eight rows' d (f16), row k at 2k
//   [16, 32)     their dmin (f16)
//   [32, 96)     the sub-block scales, 6 bits each as a byte: chunk c's eight at 32 + 8c, row k at + k
//   [96, 160)    the minimums likewise
//   [160, 1184)  the codes: for each 64 weights j (0..3) and quad q (0..7), 32 bytes: row k's
//                bytes 4q..4q+3 of the file's qs[32j..32j+32) at 4k (low nibbles: chunk 2j, high: 2j+1)
// A group is 8 consecutive "rows" of a [rows, K/256 * 148] uint8 tensor: rows stay a multiple of 8
// and a panel of rows that starts on a multiple of 8 starts on a group.
#include "layouts.h"

namespace {

constexpr int64_t GROUP_BLOCK = 1184;  // bytes of eight rows' super-block

// the file's 12 bytes of 6-bit scales and minimums (llama.cpp's get_scale_min_k4 order) as
// bytes: sc[0..8), mn[0..8)
inline void unpack_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[4 + j] & 63;
    sc[4 + j] = uint8_t((s[8 + j] & 15) | ((s[j] >> 6) << 4));
    mn[4 + j] = uint8_t((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
  }
}

inline void pack_scales(const uint8_t* sc, const uint8_t* mn, uint8_t* s) {  // unpack_scales's inverse
  for (int j = 0; j < 4; ++j) {
    s[j] = uint8_t(sc[j] | ((sc[4 + j] >> 4) << 6));
    s[4 + j] = uint8_t(mn[j] | ((mn[4 + j] >> 4) << 6));
    s[8 + j] = uint8_t((sc[4 + j] & 15) | ((mn[4 + j] & 15) << 4));
  }
}

}  // namespace

extern "C" {

// rows (a multiple of 8) of Q4_K blocks, K weights each (src rows K/256 * 144 bytes apart) ->
// dst, the same rows as Q4_K_R8 (K/256 * 148 bytes a row).
void strata_repack_q4_k(const uint8_t* src, int64_t rows, int64_t K, uint8_t* dst) {
  const int64_t nb = K / 256;
  for (int64_t g = 0; g < rows / 8; ++g)
    for (int64_t i = 0; i < nb; ++i) {
      uint8_t* o = dst + (g * nb + i) * GROUP_BLOCK;
      for (int k = 0; k < 8; ++k) {
        const uint8_t* b = src + ((8 * g + k) * nb + i) * 144;
        std::memcpy(o + 2 * k, b, 2);
        std::memcpy(o + 16 + 2 * k, b + 2, 2);
        uint8_t sc[8], mn[8];
        unpack_scales(b + 4, sc, mn);
        for (int c = 0; c < 8; ++c) o[32 + 8 * c + k] = sc[c], o[96 + 8 * c + k] = mn[c];
        for (int j = 0; j < 4; ++j)
          for (int q = 0; q < 8; ++q) std::memcpy(o + 160 + 32 * (8 * j + q) + 4 * k, b + 16 + 32 * j + 4 * q, 4);
      }
    }
}

// The inverse: rows (a multiple of 8, from a group's start) of Q4_K_R8, super-blocks [i0, i0 + n)
// of each -> dst rows of n Q4_K blocks (n * 144 bytes apart), the file's bytes bit for bit.
void strata_restore_q4_k(const uint8_t* src, int64_t rows, int64_t K, int64_t i0, int64_t n, uint8_t* dst) {
  const int64_t nb = K / 256;
  for (int64_t g = 0; g < rows / 8; ++g)
    for (int64_t i = i0; i < i0 + n; ++i) {
      const uint8_t* o = src + (g * nb + i) * GROUP_BLOCK;
      for (int k = 0; k < 8; ++k) {
        uint8_t* b = dst + ((8 * g + k) * n + (i - i0)) * 144;
        std::memcpy(b, o + 2 * k, 2);
        std::memcpy(b + 2, o + 16 + 2 * k, 2);
        uint8_t sc[8], mn[8];
        for (int c = 0; c < 8; ++c) sc[c] = o[32 + 8 * c + k], mn[c] = o[96 + 8 * c + k];
        pack_scales(sc, mn, b + 4);
        for (int j = 0; j < 4; ++j)
          for (int q = 0; q < 8; ++q) std::memcpy(b + 16 + 32 * j + 4 * q, o + 160 + 32 * (8 * j + q) + 4 * k, 4);
      }
    }
}

}  // extern "C"
