// torch ops over GGUF blocks (CPU): strata_quants::dequantize, ::mm, ::prompt_mm, ::prompt_mm_int8,
// ::mm_experts, and ::repack / ::restore (the K-quants eight rows at a time for mm: repack.cpp).
//
// mm is the decode step's product with a quantized matrix: y = x @ W^T with W kept as the
// file's blocks, read once per call in its file size, never dense. kernel.cpp does the work:
// each output row's blocks become int8 codes and per-16/per-32 scales (a few KB, in L1), summed
// against each activation row per 32 weights in integers (int8_x: x quantized per 32, as
// llama.cpp does) or float32 (the head: its error bound counts on float32 products), one scale
// applied per sum. Rows are split across torch's intra-op threads; a row's result never depends
// on the other rows of x. prompt_mm is the prompt's float32 product where oneDNN has no bf16
// kernels (below; prompt.cpp).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <string>
#include <string_view>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <type_traits>
#include <vector>

#include "isa.h"

extern "C" int strata_block_weights(int qtype);
extern "C" bool strata_takes_x16(int qtype);  // dequant.cpp
extern "C" int strata_block_bytes(int qtype);
extern "C" int strata_code_offset(int qtype);
extern "C" int strata_code_top(int qtype);
extern "C" {  // repack.cpp
bool strata_repack(int, const uint8_t*, int64_t, int64_t, uint8_t*);
bool strata_restore(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, uint8_t*);
}
extern "C" {  // kernel.cpp, its two builds
void strata_quantize_x_portable(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_quantize_x16_portable(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_mm_rows_portable(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             const float*, const int8_t*, const float*, const float*, const int8_t*,
                             const uint8_t*, float*, void*);
void strata_unpack_rows_portable(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                                 const uint8_t*, const float*, float*);
void strata_unpack_rows_bf16_portable(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                                      const uint8_t*, const float*, uint16_t*);
void strata_pack_x_portable(const float*, int64_t, int64_t, float*);
void strata_pack_w_portable(const float*, int, int64_t, float*);
void strata_prompt_panel_portable(const float*, int64_t, int64_t, int64_t, int64_t, const float*, float*, int64_t,
                                  int, float*);
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
void strata_unpack_rows_avx2(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*, const uint8_t*,
                             const float*, float*);
void strata_unpack_rows_bf16_avx2(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*,
                                  const uint8_t*, const float*, uint16_t*);
void strata_pack_x_avx2(const float*, int64_t, int64_t, float*);
void strata_pack_w_avx2(const float*, int, int64_t, float*);
void strata_prompt_panel_avx2(const float*, int64_t, int64_t, int64_t, int64_t, const float*, float*, int64_t, int,
                              float*);
void strata_quantize_x_avx2(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_quantize_x16_avx2(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_mm_rows_avx2(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float*, const int8_t*, const float*, const float*, const int8_t*,
                         const uint8_t*, float*, void*);
void strata_quantize_x_vnni(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_quantize_x16_vnni(const float*, int64_t, int64_t, int8_t*, float*, float*);
#define STRATA_PROMPT_INT8(build)                                                                                    \
  void strata_pack_codes_##build(int, const uint8_t*, int64_t, int, int64_t, int64_t, const int8_t*, const uint8_t*, \
                                 uint8_t*, float*, float*);                                                          \
  void strata_group_sums_##build(const int8_t*, int64_t, int64_t, int, int, bool, int32_t*); /* prompt_int8.cpp */   \
  void strata_pack_q32_r8_codes_##build(int, const uint8_t*, int64_t, int, int64_t, int64_t, uint8_t*, float*,       \
                                        float*);                                                                     \
  void strata_pack_q45_k_r8_codes_##build(int, const uint8_t*, int64_t, int, int64_t, int64_t, uint8_t*, float*,     \
                                          float*);                                                                   \
  void strata_pack_q6_k_r8_codes_##build(const uint8_t*, int64_t, int, int64_t, int64_t, uint8_t*, float*);         \
  void strata_prompt_panel_int8_##build(const int8_t*, const float*, const float*, const int32_t*, int64_t, int64_t, \
                                        int64_t, int64_t, const uint8_t*, const float*, const float*, int, int, bool, \
                                        bool, float*, int64_t, int, float*);
STRATA_PROMPT_INT8(avx2)
STRATA_PROMPT_INT8(vnni)
void strata_mm_rows_vnni(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float*, const int8_t*, const float*, const float*, const int8_t*,
                         const uint8_t*, float*, void*);
void strata_codes_bf16_bf16(const uint8_t*, const float*, int64_t, uint16_t*, float*, float*);  // prompt_bf16.cpp
void strata_pack_q4_r8_bf16_bf16(const uint8_t*, int64_t, int, int64_t, int64_t, uint16_t*, float*, float*);
void strata_pack_x_bf16_bf16(const float*, int64_t, int64_t, int64_t, uint16_t*);
void strata_prompt_panel_bf16_bf16(const uint16_t*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const uint16_t*,
                                   const float*, const float*, float*, int64_t, int, float*);
#endif
}

namespace {

// layouts.h: blocks repacked eight rows at a time (repack.cpp), their type + 1000; the types that
// have such a form are those dequant.cpp knows the size of
constexpr int64_t Q6_K = 14, EIGHT_ROWS = 1000;

bool eight_rows(int64_t qtype) { return qtype > EIGHT_ROWS && strata_block_weights(int(qtype)) > 0; }

// Whether a GGUF type's repacked products take 16-bit activations (layouts.h)
bool takes_x16_of(int64_t qtype) { return strata_takes_x16(int(qtype + EIGHT_ROWS)); }

bool repackable(int64_t qtype) { return qtype > 0 && qtype < EIGHT_ROWS && eight_rows(qtype + EIGHT_ROWS); }

void check(const at::Tensor& blocks, int64_t qtype, int64_t cols) {
  const int bw = strata_block_weights(int(qtype));
  TORCH_CHECK(bw > 0, "strata_quants: unsupported GGML type ", qtype);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "strata_quants: blocks must be contiguous uint8 [rows, row_bytes] on the CPU");
  TORCH_CHECK(cols % bw == 0 && blocks.size(1) == cols / bw * strata_block_bytes(int(qtype)),
              "strata_quants: ", cols, " columns do not match rows of ", blocks.size(1), " bytes");
  TORCH_CHECK(!eight_rows(qtype) || blocks.size(0) % 8 == 0, "strata_quants: repacked rows come in groups of 8");
}

// Repacked blocks (Q4_0_R8, ..., Q6_K_R8) as the file's again (exact), for the products that read
// weight rows one at a time (the portable build's, float32 activations', the whole matrix's
// unpacking); other types' blocks as they are. qtype becomes the blocks' type.
at::Tensor as_file_blocks(const at::Tensor& blocks, int64_t& qtype, int64_t cols) {
  if (!eight_rows(qtype)) return blocks;
  qtype -= EIGHT_ROWS;
  const int64_t n = cols / strata_block_weights(int(qtype)), file_type = qtype;
  at::Tensor out = at::empty({blocks.size(0), n * strata_block_bytes(int(qtype))}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t rb = blocks.size(1), ob = out.size(1);
  at::parallel_for(0, blocks.size(0) / 8, 1, [&](int64_t g0, int64_t g1) {
    strata_restore(int(file_type), src + 8 * g0 * rb, 8 * (g1 - g0), cols, 0, n, dst + 8 * g0 * ob);
  });
  return out;
}

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks [rows, cols] -> the same repacked eight
// rows at a time (rows a multiple of 8): type + 1000.
at::Tensor repack(const at::Tensor& blocks, int64_t qtype, int64_t cols) {
  TORCH_CHECK(repackable(qtype), "strata_quants::repack: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K, not ", qtype);
  check(blocks, qtype, cols);
  TORCH_CHECK(blocks.size(0) % 8 == 0, "strata_quants::repack: rows come in groups of 8, not ", blocks.size(0));
  at::Tensor out = at::empty({blocks.size(0), cols / strata_block_weights(int(qtype)) * strata_block_bytes(int(qtype + EIGHT_ROWS))},
                             blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  {  // 2 MB pages where the kernel gives them on request (THP "madvise"): the decode step streams
     // these bytes every step, and 4 KB pages cost a page walk every 4 KB of it
    const uintptr_t huge = uintptr_t(2) << 20, lo = (uintptr_t(dst) + huge - 1) & ~(huge - 1),
                    hi = (uintptr_t(dst) + out.numel()) & ~(huge - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
#endif
  const int64_t rb = blocks.size(1), ob = out.size(1);
  at::parallel_for(0, blocks.size(0) / 8, 1, [&](int64_t g0, int64_t g1) {
    strata_repack(int(qtype), src + 8 * g0 * rb, 8 * (g1 - g0), cols, dst + 8 * g0 * ob);
  });
  return out;
}

// Repacked blocks [rows, cols] (qtype Q4_0_R8, ..., Q6_K_R8) -> the file's bytes (tests: exact).
at::Tensor restore(const at::Tensor& blocks, int64_t qtype, int64_t cols) {
  TORCH_CHECK(eight_rows(qtype), "strata_quants::restore: a repacked type (a GGUF type + 1000), not ", qtype);
  check(blocks, qtype, cols);
  return as_file_blocks(blocks, qtype, cols).clone();
}

// A prompt panel's weight rows as the kernels' unpacking reads them: from src with the panel's
// k0, or for repacked blocks its rows' weights [k0, k0 + kc) restored to the file's blocks into
// `file` (16 rows x 256 weights: in L1) and k0 0 there.
struct PanelRows {
  const uint8_t* src;
  int64_t rb, k0;
  int qtype;
};

PanelRows panel_rows(const uint8_t* src, int64_t rb, int64_t qtype, int rows, int64_t K, int64_t k0, int64_t kc,
                     std::vector<uint8_t>& file) {
  if (!eight_rows(qtype)) return {src, rb, k0, int(qtype)};
  const int file_type = int(qtype - EIGHT_ROWS);
  const int64_t bw = strata_block_weights(file_type), bytes = strata_block_bytes(file_type);
  file.resize(rows * kc / bw * bytes);
  strata_restore(file_type, src, rows, K, k0 / bw, kc / bw, file.data());
  return {file.data(), kc / bw * bytes, 0, file_type};
}

const float* table_ptr(const at::Tensor& table) {
  TORCH_CHECK(table.numel() == 0 || (table.scalar_type() == at::kFloat && table.is_contiguous()),
              "strata_quants: table must be contiguous float32");
  return table.numel() ? table.data_ptr<float>() : nullptr;
}

using MmRows = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       const float*, const int8_t*, const float*, const float*, const int8_t*,
                       const uint8_t*, float*, void*);
using QuantizeX = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*);

// kernel.cpp built for AVX2 + FMA where the CPU has them (AMD and Intel since 2013-15; AVX-512
// machines too), else its portable build.
bool use_avx2() {
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && isa_cap() != "portable";
  return yes;
#else
  return false;
#endif
}

// kernel.cpp's AVX-512 VNNI build where the CPU has it (AMD Zen 4, Intel Ice Lake / Sapphire
// Rapids and later): the same bits as the AVX2 build, faster. STRATA_QUANTS_ISA=avx2 keeps the
// AVX2 build (as ONEDNN_MAX_CPU_ISA caps oneDNN), so one machine can compare the two.
bool use_vnni() {
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  static const bool yes = use_avx2() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                          isa_cap() != "avx2";
  return yes;
#else
  return false;
#endif
}

bool has_amx() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1);  // AMX-TILE
#else
  return false;
#endif
}

// The prompt's product in integers (prompt_int8.cpp) where kernel.cpp's AVX2 or VNNI build runs
// and the CPU has no AMX: there oneDNN's bf16 tiles multiply several times faster than any vector
// instruction, so the bf16 slabs stay (engine/quants/blocks.py `int8_prompt_here`).
bool int8_prompt() {
  static const bool yes = use_avx2() && !has_amx();
  return yes;
}

// The prompts of the types that take 16-bit activations (Q4_1) in bf16 from their codes
// (prompt_bf16.cpp) where the integer prompts run and the CPU has AVX-512 BF16 (AMD Zen 4 and 5):
// `vdpbf16ps` multiplies as many weights an instruction as prompt_int8.cpp's 16-bit activations
// take two `vpdpbusd` for, with less float work per block
// (engine/quants/blocks.py `bf16_prompt_here`). STRATA_QUANTS_ISA=vnni keeps the 16-bit integers.
bool bf16_prompt() {
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  static const bool yes = int8_prompt() && use_vnni() && __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512bw") && isa_cap() != "vnni";
  return yes;
#else
  return false;
#endif
}

// A type's codebook as the integers the kernels read (IQ4_XS: int8 values; IQ3_S: grid bytes
// 1..15), and as gguf's floats (dequant.cpp).
struct Codebook {
  int8_t kvalues[16] = {0};
  std::vector<uint8_t> grid;
  const float* table = nullptr;

  Codebook(int64_t qtype, const at::Tensor& t) : table(table_ptr(t)) {
    if (qtype == 23) {
      TORCH_CHECK(t.numel() == 16, "strata_quants: IQ4_XS needs its 16 values");
      for (int i = 0; i < 16; ++i) kvalues[i] = int8_t(table[i]);
    } else if (qtype == 21) {
      TORCH_CHECK(t.numel() == 2048, "strata_quants: IQ3_S needs its 512 x 4 grid");
      grid.resize(2048);
      for (int i = 0; i < 2048; ++i) grid[i] = uint8_t(table[i]);
    }
  }
};

// Each chunk of 32 of x's floats summed in order: out[c] = x[32 c] + ... + x[32 c + 31] (float32
// activations' minimum parts: `mm`'s, prompt_bf16's).
void chunk_sums(const float* x, int64_t chunks, float* out) {
  at::parallel_for(0, chunks, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float sum = 0.0f;
      for (int e = 0; e < 32; ++e) sum += x[32 * c + e];
      out[c] = sum;
    }
  });
}

template <typename T>
using UnpackRows = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const int8_t*, const uint8_t*,
                            const float*, T*);

// The unpacking into T (float, or uint16_t: bf16) of the build this CPU runs.
template <typename T>
UnpackRows<T> unpack_fn(bool portable) {
  constexpr bool f32 = std::is_same_v<T, float>;
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  if (!portable && use_avx2()) {
    if constexpr (f32) return strata_unpack_rows_avx2;
    else return strata_unpack_rows_bf16_avx2;
  }
#endif
  if constexpr (f32) return strata_unpack_rows_portable;
  else return strata_unpack_rows_bf16_portable;
}

template <typename T>
void unpack_all(const at::Tensor& blocks, int64_t qtype, int64_t cols, const at::Tensor& table, bool portable, T* dst) {
  const int64_t rows = blocks.size(0), rb = blocks.size(1);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const Codebook book(qtype, table);
  const UnpackRows<T> unpack = unpack_fn<T>(portable);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    unpack(int(qtype), src + r0 * rb, rb, r1 - r0, 0, cols, book.kvalues, book.grid.data(), book.table, dst + r0 * cols);
  });
}

// The matrix's weights: float32, gguf's values bit for bit; with bf16, those rounded to bf16 as
// torch's `.to(torch.bfloat16)` rounds them, in one pass (a prompt's slabs).
at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t cols, const at::Tensor& table, bool portable,
                      bool bf16) {
  check(blocks, qtype, cols);
  const at::Tensor file = as_file_blocks(blocks, qtype, cols);
  at::Tensor out = at::empty({blocks.size(0), cols}, blocks.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (bf16)
    unpack_all(file, qtype, cols, table, portable, reinterpret_cast<uint16_t*>(out.data_ptr()));
  else
    unpack_all(file, qtype, cols, table, portable, out.data_ptr<float>());
  return out;
}

// What a product needs besides the blocks: the kernel build, the type's codebook and the
// activation rows in the kernel's form (int8 codes per 32 with their scales, 16-bit ones for the
// repacked Q4_1 dots, or float32 x with each chunk's sum).
struct Activations {
  MmRows rows_fn = strata_mm_rows_portable;
  Codebook book;
  at::Tensor x;  // float32 [M, K], contiguous
  std::vector<int8_t> xq;
  std::vector<float> dx, sums;
  bool int8_x = false;
  int64_t width = 1;  // xq's bytes a weight: 2 for 16-bit activations

  Activations(at::Tensor x_in, int64_t qtype, const at::Tensor& table, bool int8, bool portable)
      : book(qtype, table), x(x_in.to(at::kFloat).contiguous()), int8_x(int8) {
    QuantizeX quantize_fn = strata_quantize_x_portable, quantize16_fn = strata_quantize_x16_portable;
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
    if (!portable && use_avx2())
      rows_fn = strata_mm_rows_avx2, quantize_fn = strata_quantize_x_avx2, quantize16_fn = strata_quantize_x16_avx2;
    if (!portable && use_vnni())
      rows_fn = strata_mm_rows_vnni, quantize_fn = strata_quantize_x_vnni, quantize16_fn = strata_quantize_x16_vnni;
#endif
    // the repacked Q4_1 dots: 16-bit activations (kernel.cpp strata_quantize_x16)
    if (reads_repacked() && strata_takes_x16(int(qtype))) quantize_fn = quantize16_fn, width = 2;
    const int64_t M = x.size(0), K = x.size(1), chunks = M * (K / 32);
    const float* xs = x.data_ptr<float>();
    sums.resize(chunks);
    if (int8_x) {
      xq.resize(width * M * K), dx.resize(chunks);
      quantize_fn(xs, M, K, xq.data(), dx.data(), sums.data());
    } else {
      chunk_sums(xs, chunks, sums.data());
    }
  }

  // The repacked types' eight-row dots are kernel.cpp's AVX2 builds' with int8 activations;
  // any other product reads their rows restored to the file's (as_file_blocks).
  bool reads_repacked() const { return int8_x && rows_fn != strata_mm_rows_portable; }

  // weight rows [n0, n1) of `src` (rows rb bytes apart) times activation rows [m0, m0 + M) into
  // y's rows m0.. (y [*, N], row stride N)
  void rows(int64_t qtype, const uint8_t* src, int64_t rb, int64_t n0, int64_t n1, int64_t m0, int64_t M,
            int64_t N, float* y, std::vector<float>& work) const {
    const int64_t K = x.size(1), C = K / 32;
    work.resize(K / 4 + K / 16 + K / 32 + 8);  // K int8 codes, then the scales, the minimums
    rows_fn(int(qtype), src, rb, K, n0, n1, M, N, x.data_ptr<float>() + m0 * K,
            int8_x ? xq.data() + width * m0 * K : nullptr, int8_x ? dx.data() + m0 * C : nullptr, sums.data() + m0 * C,
            book.kvalues, book.grid.data(), y + m0 * N, work.data());
  }
};

at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, const at::Tensor& table,
              bool int8_x, bool portable) {
  TORCH_CHECK(x_in.dim() == 2, "strata_quants::mm: x must be [M, K]");
  check(blocks, qtype, x_in.size(1));
  const int64_t M = x_in.size(0), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const Activations a(x_in, qtype, table, int8_x, portable);
  const at::Tensor file = a.reads_repacked() ? blocks : as_file_blocks(blocks, qtype, x_in.size(1));
  const uint8_t* src = file.data_ptr<uint8_t>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> work;
    a.rows(qtype, src, file.size(1), n0, n1, 0, M, N, ys, work);
  });
  return y;
}

constexpr int64_t KC = 256;  // a prompt panel's weights: a multiple of every type's block

// A prompt product's panels: every 16 output rows (the last `rows` <= 16) by KC weights, in order
// of k within a panel, the panels split across threads; each thread's `Scratch` made once and
// handed to fn(scratch, p, rows, k0, kc) for each of its panels.
template <typename Scratch, typename Fn>
void in_panels(int64_t N, int64_t K, Fn&& fn) {
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t p0, int64_t p1) {
    Scratch scratch;
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t k0 = 0; k0 < K; k0 += KC)
        fn(scratch, p, int(std::min<int64_t>(16, N - 16 * p)), k0, std::min(KC, K - k0));
  });
}

// The prompt's product in float32: y = x @ W^T, W unpacked from its blocks (gguf's exact values)
// 16 rows by 256 columns at a time, each such panel multiplied by every row of x (prompt.cpp).
// Every element of y is one chain of fused multiply-adds over k in order, so a row's result is
// the same bits whatever the other rows of x: a chunk of any length is one call. The work is split
// across threads by panels of 16 output columns; each unpacks only its own.
at::Tensor prompt_mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, const at::Tensor& table,
                     bool portable) {
  TORCH_CHECK(x_in.dim() == 2, "strata_quants::prompt_mm: x must be [M, K]");
  check(blocks, qtype, x_in.size(1));
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0), rb = blocks.size(1);
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  auto pack_x = strata_pack_x_portable;
  auto pack_w = strata_pack_w_portable;
  auto panel = strata_prompt_panel_portable;
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  if (!portable && use_avx2()) pack_x = strata_pack_x_avx2, pack_w = strata_pack_w_avx2, panel = strata_prompt_panel_avx2;
#endif
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  std::vector<float> ap((M + 5) / 6 * 6 * K);
  pack_x(x.data_ptr<float>(), M, K, ap.data());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const Codebook book(qtype, table);
  const UnpackRows<float> unpack = unpack_fn<float>(portable);
  float* ys = y.data_ptr<float>();
  struct Scratch {
    std::vector<float> w = std::vector<float>(16 * KC), bp = std::vector<float>(16 * KC), tmp = std::vector<float>(96);
    std::vector<uint8_t> file;
  };
  in_panels<Scratch>(N, K, [&](Scratch& t, int64_t p, int rows, int64_t k0, int64_t kc) {
    const PanelRows w = panel_rows(src + 16 * p * rb, rb, qtype, rows, K, k0, kc, t.file);
    unpack(w.qtype, w.src, w.rb, rows, w.k0, kc, book.kvalues, book.grid.data(), book.table, t.w.data());
    pack_w(t.w.data(), rows, kc, t.bp.data());
    panel(ap.data(), M, K, k0, kc, t.bp.data(), ys + 16 * p, N, rows, t.tmp.data());
  });
  return y;
}

#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
// prompt_mm_int8's pieces from one build: the VNNI one where use_vnni(), else the AVX2 one (the
// same bits, prompt_int8.cpp)
struct PromptInt8 {
  QuantizeX quantize_x, quantize_x16;
  decltype(&strata_pack_codes_avx2) pack_codes;
  decltype(&strata_group_sums_avx2) group_sums;
  decltype(&strata_pack_q32_r8_codes_avx2) pack_q32_r8;
  decltype(&strata_pack_q45_k_r8_codes_avx2) pack_q45_k_r8;
  decltype(&strata_pack_q6_k_r8_codes_avx2) pack_q6_k_r8;
  decltype(&strata_prompt_panel_int8_avx2) panel;
};

PromptInt8 prompt_int8_build() {
  if (use_vnni())
    return {strata_quantize_x_vnni, strata_quantize_x16_vnni, strata_pack_codes_vnni, strata_group_sums_vnni,
            strata_pack_q32_r8_codes_vnni, strata_pack_q45_k_r8_codes_vnni, strata_pack_q6_k_r8_codes_vnni,
            strata_prompt_panel_int8_vnni};
  return {strata_quantize_x_avx2, strata_quantize_x16_avx2, strata_pack_codes_avx2, strata_group_sums_avx2,
          strata_pack_q32_r8_codes_avx2, strata_pack_q45_k_r8_codes_avx2, strata_pack_q6_k_r8_codes_avx2,
          strata_prompt_panel_int8_avx2};
}

// Q4_1's prompt product (layouts.h takes_x16) where `bf16_prompt()` (prompt_int8's shape: panels
// of 16 output columns by 256 weights, each multiplied by every row of x): x rounded to bf16 once, each
// panel's codes turned to bf16 words (prompt_bf16.cpp: straight from repacked rows, else through
// prompt_int8's codes), into y [M, N].
// x float32 contiguous; qtype the blocks' (Q4_1, or repacked).
at::Tensor prompt_bf16(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, at::Tensor y) {
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0), rb = blocks.size(1);
  const int64_t Mp = (M + 7) / 8 * 8, C = K / 32;  // rows padded to the 8-row micro-panels
  std::vector<uint16_t> xb((K + KC - 1) / KC * Mp * KC);
  strata_pack_x_bf16_bf16(x.data_ptr<float>(), M, Mp, K, xb.data());  // as oneDNN's bf16 products round x
  std::vector<float> xs(Mp * C, 0.0f);
  chunk_sums(x.data_ptr<float>(), M * C, xs.data());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* ys = y.data_ptr<float>();
  struct Scratch {
    std::vector<uint8_t> codes = std::vector<uint8_t>(16 * KC);
    std::vector<uint16_t> w = std::vector<uint16_t>(16 * KC);
    std::vector<float> s = std::vector<float>(KC), d = std::vector<float>(KC / 2), m = std::vector<float>(KC / 2),
                       tmp = std::vector<float>(128);
  };
  in_panels<Scratch>(N, K, [&](Scratch& t, int64_t p, int rows, int64_t k0, int64_t kc) {
    if (eight_rows(qtype)) {  // straight from the repacked rows (whole groups of eight)
      strata_pack_q4_r8_bf16_bf16(src + 16 * p * rb, rb, rows, k0, kc, t.w.data(), t.d.data(), t.m.data());
    } else {
      strata_pack_codes_vnni(int(qtype), src + 16 * p * rb, rb, rows, k0, kc, nullptr, nullptr,  // no codebook
                             t.codes.data(), t.s.data(), t.m.data());
      strata_codes_bf16_bf16(t.codes.data(), t.s.data(), kc, t.w.data(), t.d.data(), t.m.data());
    }
    strata_prompt_panel_bf16_bf16(xb.data(), xs.data(), M, Mp, K, k0, kc, t.w.data(), t.d.data(), t.m.data(), ys + 16 * p,
                                  N, rows, t.tmp.data());
  });
  return y;
}
#endif

// The prompt's product in integers where `int8_prompt()` (Q4_1 where `bf16_prompt()`: in
// bf16, `prompt_bf16` above): x quantized per 32 as `mm` quantizes
// it, W's codes unpacked 16 rows by 256 weights at a time into panels of unsigned bytes and
// their scales, each multiplied by every row of x (prompt_int8.cpp). As prompt_mm, every output
// is one fixed chain of operations over k, so a row's result is the same bits whatever else the
// call holds, and the work is split across threads by panels of 16 output columns.
at::Tensor prompt_mm_int8(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, const at::Tensor& table) {
  TORCH_CHECK(x_in.dim() == 2, "strata_quants::prompt_mm_int8: x must be [M, K]");
  check(blocks, qtype, x_in.size(1));
  const int64_t M = x_in.size(0), K = x_in.size(1), N = blocks.size(0), rb = blocks.size(1);
  at::Tensor y = at::empty({M, N}, x_in.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  TORCH_CHECK(use_avx2(), "strata_quants::prompt_mm_int8 needs AVX2");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t Mp = (M + 3) / 4 * 4, C = K / 32;  // rows padded to the 4-row micro-panels
  // Q6_K's scales are per 16 weights; the types with minimums are those whose codes are never
  // negative (Q4_1, Q5_1, Q4_K, Q5_K): no offset to take back
  const int64_t file_type = eight_rows(qtype) ? qtype - EIGHT_ROWS : qtype;
  const int offset = strata_code_offset(int(file_type));
  const bool fine = file_type == Q6_K, mins = offset == 0;
  const int top = strata_code_top(int(file_type));
  const PromptInt8 f = prompt_int8_build();
  // Q4_1: 16-bit activations, as its decode products (layouts.h takes_x16)
  const bool wide = takes_x16_of(file_type);
  if (wide && bf16_prompt()) return prompt_bf16(x, blocks, qtype, y);
  const int G = fine ? 16 : 32, width = wide ? 2 : 1;
  std::vector<int8_t> xq(width * Mp * K, 0);
  std::vector<float> dx(Mp * C, 0.0f), xs(Mp * C, 0.0f);
  std::vector<int32_t> corr(Mp * K / G, 0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    int8_t* rows = xq.data() + width * r0 * K;
    (wide ? f.quantize_x16 : f.quantize_x)(x.data_ptr<float>() + r0 * K, r1 - r0, K, rows, dx.data() + r0 * C,
                                           xs.data() + r0 * C);
    if (!mins) f.group_sums(rows, r1 - r0, K, G, offset, wide, corr.data() + r0 * K / G);
  });
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const Codebook book(qtype, table);
  float* ys = y.data_ptr<float>();
  struct Scratch {
    std::vector<uint8_t> codes = std::vector<uint8_t>(16 * KC);
    std::vector<float> s = std::vector<float>(KC), m = std::vector<float>(KC / 2), tmp = std::vector<float>(64);
  };
  in_panels<Scratch>(N, K, [&](Scratch& t, int64_t p, int rows, int64_t k0, int64_t kc) {
    const uint8_t* panel = src + 16 * p * rb;
    // repacked rows are already the panel's order by quads: no restoring to the file's blocks
    if (!eight_rows(qtype))
      f.pack_codes(int(qtype), panel, rb, rows, k0, kc, book.kvalues, book.grid.data(), t.codes.data(), t.s.data(),
                   t.m.data());
    else if (strata_block_weights(int(file_type)) == 32)
      f.pack_q32_r8(int(file_type), panel, rb, rows, k0, kc, t.codes.data(), t.s.data(), t.m.data());
    else if (file_type == Q6_K)
      f.pack_q6_k_r8(panel, rb, rows, k0, kc, t.codes.data(), t.s.data());
    else  // Q4_K, Q5_K
      f.pack_q45_k_r8(int(file_type), panel, rb, rows, k0, kc, t.codes.data(), t.s.data(), t.m.data());
    f.panel(xq.data(), dx.data(), xs.data(), corr.data(), M, K, k0, kc, t.codes.data(), t.s.data(), t.m.data(),
            offset, top, fine, wide, ys + 16 * p, N, rows, t.tmp.data());
  });
#else
  TORCH_CHECK(false, "strata_quants::prompt_mm_int8 needs AVX2");
#endif
  return y;
}

// An MoE layer's routed products: y[p] = x[p] @ W[experts[p]]^T for each (row, expert) pair p,
// the experts' matrices kept as their file blocks [E, N, row_bytes]. The pairs are sorted by
// expert (stable) so that each chosen expert's rows are unpacked once for all the pairs routed to
// it and an expert no pair chose is never read; the work is split across threads over (chosen
// expert, weight row). Each pair's result is `mm`'s for its row alone, bit for bit.
at::Tensor mm_experts(const at::Tensor& x_in, const at::Tensor& blocks, const at::Tensor& experts, int64_t qtype,
                      const at::Tensor& table, bool int8_x, bool portable) {
  TORCH_CHECK(x_in.dim() == 2, "strata_quants::mm_experts: x must be [P, K]");
  TORCH_CHECK(!eight_rows(qtype), "strata_quants::mm_experts: experts are kept as the file's blocks, not repacked");
  TORCH_CHECK(blocks.dim() == 3 && blocks.is_contiguous(), "strata_quants::mm_experts: blocks must be contiguous [E, N, row_bytes]");
  TORCH_CHECK(experts.dim() == 1 && experts.size(0) == x_in.size(0) && experts.device().is_cpu(),
              "strata_quants::mm_experts: experts must be [P], one per row of x");
  const int64_t P = x_in.size(0), E = blocks.size(0), N = blocks.size(1), rb = blocks.size(2);
  check(blocks.view({E * N, rb}), qtype, x_in.size(1));
  at::Tensor y = at::empty({P, N}, x_in.options().dtype(at::kFloat));
  if (P == 0 || N == 0) return y;
  const at::Tensor ids = experts.to(at::kLong).contiguous();
  const int64_t* chosen = ids.data_ptr<int64_t>();
  // counting sort: start[e] = the first sorted pair of expert e
  std::vector<int64_t> start(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(chosen[p] >= 0 && chosen[p] < E, "strata_quants::mm_experts: expert ", chosen[p], " of ", E);
    ++start[chosen[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[next[chosen[p]]++] = p;
  std::vector<int64_t> active;  // the chosen experts, in order
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const at::Tensor idx = at::from_blob(order.data(), {P}, at::kLong);
  const Activations a(x_in.to(at::kFloat).index_select(0, idx), qtype, table, int8_x, portable);
  at::Tensor sorted = at::empty({P, N}, y.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* ys = sorted.data_ptr<float>();
  const int64_t A = int64_t(active.size());
  at::parallel_for(0, A * N, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> work;
    for (int64_t i = i0; i < i1;) {  // the stretch of one expert's rows in [i0, i1)
      const int64_t j = i / N, n0 = i % N, n1 = std::min(N, n0 + (i1 - i));
      const int64_t e = active[j];
      a.rows(qtype, src + e * N * rb, rb, n0, n1, start[e], start[e + 1] - start[e], N, ys, work);
      i += n1 - n0;
    }
  });
  y.index_copy_(0, idx, sorted);
  return y;
}

// Which build of kernel.cpp `mm` runs here (tests, bench notes): "vnni", "avx2" or "portable".
std::string mm_build() { return use_vnni() ? "vnni" : use_avx2() ? "avx2" : "portable"; }

}  // namespace

TORCH_LIBRARY(strata_quants, m) {
  m.def("dequantize(Tensor blocks, int qtype, int cols, Tensor table, bool portable=False, bool bf16=False) -> Tensor");
  m.def("mm(Tensor x, Tensor blocks, int qtype, Tensor table, bool int8_x=False, bool portable=False) -> Tensor");
  m.def("prompt_mm(Tensor x, Tensor blocks, int qtype, Tensor table, bool portable=False) -> Tensor");
  m.def("mm_experts(Tensor x, Tensor blocks, Tensor experts, int qtype, Tensor table, bool int8_x=False, "
        "bool portable=False) -> Tensor");
  m.def("prompt_mm_int8(Tensor x, Tensor blocks, int qtype, Tensor table) -> Tensor");
  m.def("repack(Tensor blocks, int qtype, int cols) -> Tensor");
  m.def("restore(Tensor blocks, int qtype, int cols) -> Tensor");
  m.def("mm_build() -> str", &mm_build);
  m.def("takes_x16(int qtype) -> bool", &takes_x16_of);
  m.def("int8_prompt() -> bool", &int8_prompt);
  m.def("bf16_prompt() -> bool", &bf16_prompt);
}

TORCH_LIBRARY_IMPL(strata_quants, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("mm", &mm);
  m.impl("prompt_mm", &prompt_mm);
  m.impl("prompt_mm_int8", &prompt_mm_int8);
  m.impl("mm_experts", &mm_experts);
  m.impl("repack", &repack);
  m.impl("restore", &restore);
}
