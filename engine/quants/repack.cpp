// A GGUF matrix's blocks repacked eight weight rows at a time (`Q4_K_R8`, ..., `Q8_0_R8`: the
// type + 1000), so that the decode step's dots (kernel.cpp `dot_q45_k_r8`, `dot_q6_k_r8`,
// `dot_q32_r8`) hold one weight row per lane of a register: a chunk's float work (its integer
// sum converted, times the scales and dx, the minimum or offset times the chunk's sum) is one
// operation for eight rows, with no horizontal sums, and the scales are ready to widen. Exact
// repackings: every bit of the file's blocks is kept, moved. A group is 8 consecutive "rows" of
// a [rows, K/block * row bytes] uint8 tensor: rows stay a multiple of 8 and a panel of rows that
// starts on a multiple of 8 starts on a group.
//
// The 32-weight types, per group of eight rows and block (32 weights), the file's bytes (8 x 18,
// 20, 22, 24, 34), in the order the dot reads them:
//   [0, 16)      the eight rows' d (f16), row k at 2k
//   [16, 32)     Q4_1, Q5_1: their m (f16)
//   then Q5_0, Q5_1: the fifth bits, 32 bytes: row k's at 4k, byte b's bit s = the file's qh bit
//                4s + b (the code of weight 4s + b: lane k's byte b of the dot's s-th quad)
//   then the codes: Q4_0 .. Q5_1, for each quad q (0..3) 32 bytes: row k's qs[4q..4q+4) at 4k
//                (low nibbles: weights 4q.., high: 16 + 4q..); Q8_0, for each quad q (0..7) 32
//                bytes: row k's qs[4q..4q+4) at 4k
//
// Q4_K_R8, per group of eight rows and super-block (256 weights), 1184 bytes (8 x 148 against the
// file's 8 x 144), in the order the dot reads them:
//   [0, 16)      the eight rows' d (f16), row k at 2k
//   [16, 32)     their dmin (f16)
//   [32, 96)     the sub-block scales, 6 bits each as a byte: chunk c's eight at 32 + 8c, row k at + k
//   [96, 160)    the minimums likewise
//   [160, 1184)  the codes: for each 64 weights j (0..3) and quad q (0..7), 32 bytes: row k's
//                bytes 4q..4q+3 of the file's qs[32j..32j+32) at 4k (low nibbles: chunk 2j, high: 2j+1)
//
// Q5_K_R8, 1440 bytes (8 x 180 against 8 x 176): Q4_K_R8's first 160 bytes, then the high bits,
// for each quad q 32 bytes: row k's qh[4q..4q+4) at 4k (bit c: chunk c's), at 160 + 32q, then
// Q4_K_R8's codes from 416.
//
// Q6_K_R8, 1680 bytes (8 x 210, the file's size):
//   [0, 16)      the eight rows' d (f16)
//   [16, 144)    the int8 scales: group g (16 weights) at 16 + 8g, row k at + k
//   [144, 1680)  each half h (128 weights) in 768 bytes from 144 + 768h, in the order its chunks
//                read them (one stream for the prefetcher: an order that jumped between the
//                low and high bits' regions ran at a third of the speed):
//                qh: for each quad q, 32 bytes: row k's qh[32h + 4q..] at 4k (bits 2j, 2j + 1:
//                chunk 4h + j's high bits), at + 32q;
//                ql: for source t (ql[64h..+32) or ql[64h+32..+32)) and quad q, 32 bytes: row k's
//                four bytes 4q.. of it at 4k (low nibbles: chunk 4h + t, high: 4h + t + 2), at
//                + 256 + 32 * (8t + q)
#include "layouts.h"

#include <array>

extern "C" int strata_block_weights(int qtype);  // dequant.cpp

namespace {


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

// n bytes between a row's block in the file's layout (b) and its place in the group's (o): into
// the group when repacking, back when restoring. One description of each layout serves both.
template <bool Restore>
inline void move(uint8_t* b, uint8_t* o, int n) {
  if constexpr (Restore) std::memcpy(b, o, n);
  else std::memcpy(o, b, n);
}

// Row k's Q4_K (or Q5_K: Five) block b and its places in the group's super-block o (the layouts
// above).
template <bool Restore, bool Five = false>
inline void q45_k_row(uint8_t* b, uint8_t* o, int k) {
  constexpr int qs = Five ? 48 : 16, codes = Five ? 416 : 160;
  move<Restore>(b, o + 2 * k, 2);
  move<Restore>(b + 2, o + 16 + 2 * k, 2);
  uint8_t sc[8], mn[8];
  if constexpr (!Restore) unpack_scales(b + 4, sc, mn);
  for (int c = 0; c < 8; ++c) {
    move<Restore>(sc + c, o + 32 + 8 * c + k, 1);
    move<Restore>(mn + c, o + 96 + 8 * c + k, 1);
  }
  if constexpr (Restore) pack_scales(sc, mn, b + 4);
  for (int j = 0; j < 4; ++j)
    for (int q = 0; q < 8; ++q) move<Restore>(b + qs + 32 * j + 4 * q, o + codes + 32 * (8 * j + q) + 4 * k, 4);
  if constexpr (Five)
    for (int q = 0; q < 8; ++q) move<Restore>(b + 16 + 4 * q, o + 160 + 32 * q + 4 * k, 4);
}

// Row k's Q6_K block b and its places in the group's super-block o.
template <bool Restore>
inline void q6_k_row(uint8_t* b, uint8_t* o, int k) {
  move<Restore>(b + 208, o + 2 * k, 2);
  for (int s = 0; s < 16; ++s) move<Restore>(b + 192 + s, o + 16 + 8 * s + k, 1);
  for (int h = 0; h < 2; ++h)
    for (int q = 0; q < 8; ++q) {
      for (int t = 0; t < 2; ++t)
        move<Restore>(b + 64 * h + 32 * t + 4 * q, o + 144 + 768 * h + 256 + 32 * (8 * t + q) + 4 * k, 4);
      move<Restore>(b + 128 + 32 * h + 4 * q, o + 144 + 768 * h + 32 * q + 4 * k, 4);
    }
}

// A byte's bit s at bit 4s of a word, for every byte.
constexpr std::array<uint32_t, 256> FOURTHS = [] {
  std::array<uint32_t, 256> t{};
  for (int v = 0; v < 256; ++v)
    for (int s = 0; s < 8; ++s) t[v] |= uint32_t((v >> s) & 1) << (4 * s);
  return t;
}();

// Row k's 32-weight block b and its places in the group's block o (the layout above).
template <bool Restore, int T>
inline void q32_row(uint8_t* b, uint8_t* o, int k) {
  constexpr int scales = T == Q4_1 || T == Q5_1 ? 2 : 1;  // d, and m
  constexpr bool five = T == Q5_0 || T == Q5_1;
  constexpr int qs = 2 * scales + (five ? 4 : 0), codes = 16 * scales + (five ? 32 : 0), quads = T == Q8_0 ? 8 : 4;
  for (int e = 0; e < scales; ++e) move<Restore>(b + 2 * e, o + 16 * e + 2 * k, 2);
  if constexpr (five) {  // qh's 32 bits, bit 4s + b to byte b's bit s (and back)
    uint8_t* spread = o + 16 * scales + 4 * k;
    uint32_t bits = 0;
    if constexpr (Restore) {  // a prompt panel's every block: by table
      for (int c = 0; c < 4; ++c) bits |= FOURTHS[spread[c]] << c;
      std::memcpy(b + 2 * scales, &bits, 4);
    } else {
      std::memcpy(&bits, b + 2 * scales, 4);
      for (int c = 0; c < 4; ++c) spread[c] = 0;
      for (int e = 0; e < 32; ++e) spread[e % 4] |= uint8_t(((bits >> e) & 1) << (e / 4));
    }
  }
  for (int q = 0; q < quads; ++q) move<Restore>(b + qs + 4 * q, o + codes + 32 * q + 4 * k, 4);
}

// row(b, o, k) for every row k of every group of `rows` and block i in [i0, i0 + n): b the
// row's block in file-layout rows of n blocks (FileBytes each), o the group's block i
// (Weights each).
template <int64_t Weights, int64_t FileBytes, int64_t GroupBytes, typename Row>
void each_block(uint8_t* file, uint8_t* groups, int64_t rows, int64_t K, int64_t i0, int64_t n, Row row) {
  const int64_t nb = K / Weights;
  for (int64_t g = 0; g < rows / 8; ++g)
    for (int64_t i = i0; i < i0 + n; ++i)
      for (int k = 0; k < 8; ++k)
        row(file + ((8 * g + k) * n + (i - i0)) * FileBytes, groups + (g * nb + i) * GroupBytes, k);
}

// Between file-layout rows and groups (Restore: back), blocks [i0, i0 + n) of each row: false
// for a type with no repacked form.
template <bool Restore>
bool each_row_of(int qtype, uint8_t* file, uint8_t* groups, int64_t rows, int64_t K, int64_t i0, int64_t n) {
  switch (qtype) {  // the file's bytes of a row's block, the group's of a block
    case Q4_0: each_block<32, 18, 144>(file, groups, rows, K, i0, n, q32_row<Restore, Q4_0>); return true;
    case Q4_1: each_block<32, 20, 160>(file, groups, rows, K, i0, n, q32_row<Restore, Q4_1>); return true;
    case Q5_0: each_block<32, 22, 176>(file, groups, rows, K, i0, n, q32_row<Restore, Q5_0>); return true;
    case Q5_1: each_block<32, 24, 192>(file, groups, rows, K, i0, n, q32_row<Restore, Q5_1>); return true;
    case Q8_0: each_block<32, 34, 272>(file, groups, rows, K, i0, n, q32_row<Restore, Q8_0>); return true;
    case Q4_K: each_block<256, 144, 1184>(file, groups, rows, K, i0, n, q45_k_row<Restore>); return true;
    case Q5_K: each_block<256, 176, 1440>(file, groups, rows, K, i0, n, q45_k_row<Restore, true>); return true;
    case Q6_K: each_block<256, 210, 1680>(file, groups, rows, K, i0, n, q6_k_row<Restore>); return true;
    default: return false;
  }
}

}  // namespace

extern "C" {

// rows (a multiple of 8) of a type's blocks, K weights each (src rows K / block * its bytes apart)
// -> dst, the same rows repacked (its type + 1000: dequant.cpp's bytes a row). False for a type
// with no repacked form.
bool strata_repack(int qtype, const uint8_t* src, int64_t rows, int64_t K, uint8_t* dst) {
  return each_row_of<false>(qtype, const_cast<uint8_t*>(src), dst, rows, K, 0, K / strata_block_weights(qtype));
}

// The inverse: rows (a multiple of 8, from a group's start) repacked from type qtype, blocks [i0,
// i0 + n) of each -> dst rows of n of the file's blocks, the file's bytes bit for bit.
bool strata_restore(int qtype, const uint8_t* src, int64_t rows, int64_t K, int64_t i0, int64_t n, uint8_t* dst) {
  return each_row_of<true>(qtype, dst, const_cast<uint8_t*>(src), rows, K, i0, n);
}

}  // extern "C"
