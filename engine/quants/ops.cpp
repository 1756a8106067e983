// torch ops over GGUF blocks (CPU): strata_quants::dequantize and strata_quants::mm.
//
// mm is the decode step's product with a quantized matrix: y = x @ W^T with W kept as the
// file's blocks. Each output row of W is unpacked (dequant.cpp, bit for bit gguf's values) into
// a buffer that stays in L1/L2 and is dotted at once with every row of x in float32, so the
// matrix is read once per call in its file size and never exists dense. Rows are split across
// torch's intra-op threads.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

extern "C" int strata_block_weights(int qtype);
extern "C" int strata_block_bytes(int qtype);
void strata_dequant_row(int qtype, const uint8_t* src, float* y, int64_t cols, const float* table);

namespace {

// float32 dot of two vectors of n (a multiple of 32) floats: 32 independent partial sums, so
// the compiler keeps them in vector registers with fused multiply-adds.
__attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
float dot(const float* a, const float* b, int64_t n) {
  float acc[32] = {0};
  for (int64_t k = 0; k < n; k += 32)
    for (int j = 0; j < 32; ++j) acc[j] += a[k + j] * b[k + j];
  float s = 0;
  for (int j = 0; j < 32; ++j) s += acc[j];
  return s;
}

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

at::Tensor mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, const at::Tensor& table) {
  TORCH_CHECK(x_in.dim() == 2, "strata_quants::mm: x must be [M, K]");
  const int64_t K = x_in.size(1);
  check(blocks, qtype, K);
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), N = blocks.size(0), rb = blocks.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const float* tab = table_ptr(table);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> w(K);
    for (int64_t n = n0; n < n1; ++n) {
      strata_dequant_row(int(qtype), src + n * rb, w.data(), K, tab);
      for (int64_t m = 0; m < M; ++m) ys[m * N + n] = dot(xs + m * K, w.data(), K);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(strata_quants, m) {
  m.def("dequantize(Tensor blocks, int qtype, int cols, Tensor table) -> Tensor");
  m.def("mm(Tensor x, Tensor blocks, int qtype, Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_quants, CPU, m) {
  m.impl("dequantize", &dequantize);
  m.impl("mm", &mm);
}
