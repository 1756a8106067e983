// strata_attend::decode (CPU): a decode step's attention read straight from the KV pool.
//
// The pool keeps every slot's K/V in shared blocks ([KV, positions, entry] per layer, the
// positions of a row in its block table: read_at). torch's way to attend over them is to gather
// each row's positions into a dense copy first (index_select), then matmul / softmax / matmul:
// the pool's rows are read, written once more and read again. Here each (row, KV head) reads its
// positions where they lie, once for the scores and once for the weighted sum, with the group of
// query heads that share the KV head (GQA) and the row's tokens (prompt lookup's guesses) dotted
// against each K entry while it is in L1. Masked positions are never read.
//
// Arithmetic: float32 throughout, as engine/layers.py's `attend_plain`. A dot product is summed
// in 8 fixed lanes then combined in a fixed order, with no fused multiply-add (built with
// -ffp-contract=off), so the AVX2 clone and the baseline one give the same bits, and a row's
// result never depends on the other rows or the thread count (one task per row and KV head).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    for (int j = 0; j < 8; ++j) lane[j] += a[d + j] * b[d + j];
  float tail = 0.0f;
  for (; d < n; ++d) tail += a[d] * b[d];
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7])) + tail;
}

inline void add_scaled(float* acc, float p, const float* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += p * v[d];
}

// One pool entry as float32: bf16 widened, int8 times its scale (the entry's last 4 bytes, as
// engine/kv_dtype.py `load` does it), float32 itself (no copy).
enum class Entry { F32, BF16, I8 };

inline const float* entry(Entry kind, const uint8_t* p, int64_t n, float* tmp) {
  switch (kind) {
    case Entry::F32:
      return reinterpret_cast<const float*>(p);
    case Entry::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
      for (int64_t d = 0; d < n; ++d) {
        const uint32_t bits = uint32_t(h[d]) << 16;
        std::memcpy(tmp + d, &bits, 4);
      }
      return tmp;
    }
    case Entry::I8: {
      const int8_t* q = reinterpret_cast<const int8_t*>(p);
      float s;
      std::memcpy(&s, p + n, 4);
      for (int64_t d = 0; d < n; ++d) tmp[d] = float(q[d]) * s;
      return tmp;
    }
  }
  return nullptr;
}

struct Shapes {
  int64_t B, T, H, KV, G, D, L, N, W;  // W: an entry's bytes
};

// The (row b, KV head h) task: its G*T queries over the row's L positions.
CLONES void attend_one(const Shapes& s, int64_t b, int64_t h, Entry kind, float scale, const float* q,
                       const uint8_t* kp, const uint8_t* vp, const int64_t* read_at, const bool* mask, float* out) {
  const int64_t Q = s.G * s.T, D = s.D, L = s.L;
  std::vector<float> scores(Q * L), acc(Q * D, 0.0f), tmp(D);
  std::vector<int64_t> seen;  // positions any of the row's tokens sees
  const bool* m = mask + b * s.T * L;
  const int64_t* at = read_at + b * L;
  const uint8_t* kh = kp + h * s.N * s.W;
  const uint8_t* vh = vp + h * s.N * s.W;
  // query i = (g, t): head h * G + g, token t of row b
  auto query = [&](int64_t i) { return q + ((b * s.T + i % s.T) * s.H + h * s.G + i / s.T) * D; };
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < L; ++l) {
    bool any = false;
    for (int64_t t = 0; t < s.T; ++t) any |= m[t * L + l];
    if (!any) {
      for (int64_t i = 0; i < Q; ++i) scores[i * L + l] = minus_inf;
      continue;
    }
    seen.push_back(l);
    const float* k = entry(kind, kh + at[l] * s.W, D, tmp.data());
    for (int64_t i = 0; i < Q; ++i)
      scores[i * L + l] = m[(i % s.T) * L + l] ? dot(query(i), k, D) * scale : minus_inf;
  }
  for (int64_t i = 0; i < Q; ++i) {  // softmax over each query's scores
    float* row = scores.data() + i * L;
    float top = minus_inf;
    for (int64_t l : seen) top = std::max(top, row[l]);
    if (top == minus_inf) continue;  // sees nothing (a padding row): zeros out
    float sum = 0.0f;
    for (int64_t l : seen) {
      row[l] = row[l] == minus_inf ? 0.0f : std::exp(row[l] - top);
      sum += row[l];
    }
    for (int64_t l : seen) row[l] /= sum;
  }
  for (int64_t l : seen) {
    const float* v = entry(kind, vh + at[l] * s.W, D, tmp.data());
    for (int64_t i = 0; i < Q; ++i) {
      const float p = scores[i * L + l];
      if (p != 0.0f && m[(i % s.T) * L + l]) add_scaled(acc.data() + i * D, p, v, D);
    }
  }
  for (int64_t i = 0; i < Q; ++i)  // out [B, T, H * D]
    std::memcpy(out + ((b * s.T + i % s.T) * s.H + h * s.G + i / s.T) * D, acc.data() + i * D, D * 4);
}

// q [B, T, H, D] float32; k_pool, v_pool [KV, N, W] float32 / bfloat16 / int8 (W = D, or D + 4
// for int8: the scale's bytes); read_at [B, L] int64; mask [B, T, L] bool -> [B, T, H * D] float32.
at::Tensor decode(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& read_at_in,
                  const at::Tensor& mask_in, double scale) {
  TORCH_CHECK(q_in.dim() == 4 && k_pool.dim() == 3 && read_at_in.dim() == 2 && mask_in.dim() == 3,
              "strata_attend::decode: q [B, T, H, D], pools [KV, N, W], read_at [B, L], mask [B, T, L]");
  TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && k_pool.scalar_type() == v_pool.scalar_type() &&
                  k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.device().is_cpu(),
              "strata_attend::decode: K and V pools must be alike, contiguous, on the CPU");
  const at::Tensor q = q_in.to(at::kFloat).contiguous();
  const at::Tensor read_at = read_at_in.to(at::kLong).contiguous();
  const at::Tensor mask = mask_in.to(at::kBool).contiguous();
  Shapes s{q.size(0), q.size(1), q.size(2), k_pool.size(0), 0, q.size(3), read_at.size(1), k_pool.size(1), 0};
  TORCH_CHECK(s.KV > 0 && s.H % s.KV == 0, "strata_attend::decode: ", s.H, " query heads over ", s.KV, " KV heads");
  s.G = s.H / s.KV;
  Entry kind;
  int64_t width;
  switch (k_pool.scalar_type()) {
    case at::kFloat: kind = Entry::F32, width = s.D; break;
    case at::kBFloat16: kind = Entry::BF16, width = s.D; break;
    case at::kChar: kind = Entry::I8, width = s.D + 4; break;
    default: TORCH_CHECK(false, "strata_attend::decode: a ", k_pool.scalar_type(), " pool (float32, bfloat16 or int8)");
  }
  TORCH_CHECK(k_pool.size(2) == width, "strata_attend::decode: entries of ", k_pool.size(2), " elements for head_dim ", s.D);
  TORCH_CHECK(read_at.size(0) == s.B && mask.size(0) == s.B && mask.size(1) == s.T && mask.size(2) == s.L,
              "strata_attend::decode: read_at / mask do not match q's rows and tokens");
  if (read_at.numel() > 0)
    TORCH_CHECK(read_at.min().item<int64_t>() >= 0 && read_at.max().item<int64_t>() < s.N,
                "strata_attend::decode: read_at has places outside the pool's ", s.N);
  s.W = width * k_pool.element_size();
  at::Tensor out = at::empty({s.B, s.T, s.H * s.D}, q.options());
  const float* qs = q.data_ptr<float>();
  const uint8_t* kp = static_cast<const uint8_t*>(k_pool.data_ptr());
  const uint8_t* vp = static_cast<const uint8_t*>(v_pool.data_ptr());
  const int64_t* at_ = read_at.data_ptr<int64_t>();
  const bool* ms = mask.data_ptr<bool>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, s.B * s.KV, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) attend_one(s, i / s.KV, i % s.KV, kind, float(scale), qs, kp, vp, at_, ms, os);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(strata_attend, m) {
  m.def("decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor read_at, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_attend, CPU, m) { m.impl("decode", &decode); }
