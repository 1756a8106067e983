// torch ops over GGUF blocks (CPU): strata_quants::dequantize and strata_quants::mm.
//
// mm is the decode step's product with a quantized matrix: y = x @ W^T with W kept as the
// file's blocks, read once per call in its file size, never dense. kernel.cpp does the work:
// each output row's blocks become int8 codes and per-16/per-32 scales (a few KB, in L1), summed
// against each activation row per 32 weights in integers (int8_x: x quantized per 32, as
// llama.cpp does) or float32 (the head: its error bound counts on float32 products), one scale
// applied per sum. Rows are split across torch's intra-op threads; a row's result never depends
// on the other rows of x.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

extern "C" int strata_block_weights(int qtype);
extern "C" int strata_block_bytes(int qtype);
void strata_dequant_row(int qtype, const uint8_t* src, float* y, int64_t cols, const float* table);
extern "C" {  // kernel.cpp, its two builds
void strata_quantize_x_portable(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_mm_rows_portable(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             const float*, const int8_t*, const float*, const float*, const int8_t*,
                             const uint8_t*, float*, void*);
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
void strata_quantize_x_avx2(const float*, int64_t, int64_t, int8_t*, float*, float*);
void strata_mm_rows_avx2(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         const float*, const int8_t*, const float*, const float*, const int8_t*,
                         const uint8_t*, float*, void*);
#endif
}

namespace {

void check(const at::Tensor& blocks, int64_t qtype, int64_t cols) {
  const int bw = strata_block_weights(int(qtype));
  TORCH_CHECK(bw > 0, "strata_quants: unsupported GGML type ", qtype);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "strata_quants: blocks must be contiguous uint8 [rows, row_bytes] on the CPU");
  TORCH_CHECK(cols % bw == 0 && blocks.size(1) == cols / bw * strata_block_bytes(int(qtype)),
              "strata_quants: ", cols, " columns do not match rows of ", blocks.size(1), " bytes");
}

const float* table_ptr(const at::Tensor& table) {
  TORCH_CHECK(table.numel() == 0 || (table.scalar_type() == at::kFloat && table.is_contiguous()),
              "strata_quants: table must be contiguous float32");
  return table.numel() ? table.data_ptr<float>() : nullptr;
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t cols, const at::Tensor& table) {
  check(blocks, qtype, cols);
  const int64_t rows = blocks.size(0), rb = blocks.size(1);
  at::Tensor out = at::empty({rows, cols}, blocks.options().dtype(at::kFloat));
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  const float* tab = table_ptr(table);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) strata_dequant_row(int(qtype), src + r * rb, dst + r * cols, cols, tab);
  });
  return out;
}

using MmRows = void (*)(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                       const float*, const int8_t*, const float*, const float*, const int8_t*,
                       const uint8_t*, float*, void*);
using QuantizeX = void (*)(const float*, int64_t, int64_t, int8_t*, float*, float*);

// kernel.cpp built for AVX2 + FMA where the CPU has them (AMD and Intel since 2013-15; AVX-512
// machines too), else its portable build.
bool use_avx2() {
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, const at::Tensor& table,
              bool int8_x, bool portable) {
  TORCH_CHECK(x_in.dim() == 2, "strata_quants::mm: x must be [M, K]");
  const int64_t K = x_in.size(1);
  check(blocks, qtype, K);
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = blocks.size(0), rb = blocks.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const bool avx2 = !portable && use_avx2();
  MmRows rows_fn = strata_mm_rows_portable;
  QuantizeX quantize_fn = strata_quantize_x_portable;
#if defined(__x86_64__) && defined(STRATA_HAVE_AVX2)
  if (avx2) rows_fn = strata_mm_rows_avx2, quantize_fn = strata_quantize_x_avx2;
#endif
  const float* xs = x.data_ptr<float>();
  // the codebooks as the integers they are (IQ4_XS: int8 values; IQ3_S: grid bytes 1..15)
  int8_t kvalues[16] = {0};
  std::vector<uint8_t> grid;
  const float* tab = table_ptr(table);
  if (qtype == 23) {
    TORCH_CHECK(table.numel() == 16, "strata_quants::mm: IQ4_XS needs its 16 values");
    for (int i = 0; i < 16; ++i) kvalues[i] = int8_t(tab[i]);
  } else if (qtype == 21) {
    TORCH_CHECK(table.numel() == 2048, "strata_quants::mm: IQ3_S needs its 512 x 4 grid");
    grid.resize(2048);
    for (int i = 0; i < 2048; ++i) grid[i] = uint8_t(tab[i]);
  }
  const int64_t chunks = M * (K / 32);
  std::vector<int8_t> xq(int8_x ? M * K : 0);
  std::vector<float> dx(int8_x ? chunks : 0), sums(chunks);
  if (int8_x) {
    quantize_fn(xs, M, K, xq.data(), dx.data(), sums.data());
  } else {
    for (int64_t c = 0; c < chunks; ++c) {
      float s = 0.0f;
      for (int e = 0; e < 32; ++e) s += xs[32 * c + e];
      sums[c] = s;
    }
  }
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> work(K / 4 + K / 16 + K / 32 + 8);  // K int8 codes, then the scales, the minimums
    rows_fn(int(qtype), src, rb, K, n0, n1, M, N, xs, int8_x ? xq.data() : nullptr, dx.data(), sums.data(),
            kvalues, grid.data(), ys, work.data());
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(strata_quants, m) {
  m.def("dequantize(Tensor blocks, int qtype, int cols, Tensor table) -> Tensor");
  m.def("mm(Tensor x, Tensor blocks, int qtype, Tensor table, bool int8_x=False, bool portable=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_quants, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("mm", &mm);
}
