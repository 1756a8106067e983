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
// -ffp-contract=off), so the AVX2 build and the baseline one give the same bits, and a row's
// result never depends on the other rows or the thread count (one task per row, KV head and half
// of a long row's positions, the halves cut by the row's own count: `attend_one`).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "quants/isa.h"

// the helpers `attend_one` and `attend_one_avx2` call are compiled into each, for its own
// instruction set
#define INLINE inline __attribute__((always_inline))
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define X86_AVX2 1
#endif

namespace {

// Eight float32 lanes as GCC's vector extension: ymm registers in the AVX2 build, SSE pairs in
// the baseline, the same lane-wise products and sums (no fused multiply-add) in both.
typedef float v8 __attribute__((vector_size(32)));

INLINE v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

// Pool entries, read where they lie: float32, float16 and bf16 widened (exact), int8 times its
// scale (the entry's last 4 bytes, as engine/kv_dtype.py `load` does it).
enum class Entry { F32, F16, BF16, I8 };

// An entry's scale: int8's from its last bytes, 1 (unused) for the others.
template <Entry K>
INLINE float scale_of(const uint8_t* p, int64_t n) {
  float scale = 1.0f;
  if constexpr (K == Entry::I8) std::memcpy(&scale, p + n, 4);
  return scale;
}

// Element e of an entry as float32.
template <Entry K>
INLINE float value(const uint8_t* p, int64_t e, float scale) {
  if constexpr (K == Entry::F32) {
    float x;
    std::memcpy(&x, p + 4 * e, 4);
    return x;
  } else if constexpr (K == Entry::F16) {
    _Float16 h;
    std::memcpy(&h, p + 2 * e, 2);
    return float(h);
  } else if constexpr (K == Entry::BF16) {
    uint16_t h;
    std::memcpy(&h, p + 2 * e, 2);
    const uint32_t bits = uint32_t(h) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    return x;
  } else {
    return float(reinterpret_cast<const int8_t*>(p)[e]) * scale;
  }
}

// Elements d..d+7 of an entry as float32 lanes, each as `value` gives it. AVX2 (with F16C): by the
// widening instructions, written as asm (GCC allows an intrinsic only in a function built for its
// instruction set, and only `attend_one_avx2` instantiates these), since GCC 12 widens eight
// float16 or int8 values one element at a time.
template <Entry K, bool AVX2>
INLINE v8 lanes(const uint8_t* p, int64_t d, float scale) {
  if constexpr (K == Entry::F32) {
    return load8(reinterpret_cast<const float*>(p) + d);
  } else if constexpr (K == Entry::F16 && AVX2) {
    v8 x;
    asm("vcvtph2ps %1, %0" : "=x"(x) : "m"(*reinterpret_cast<const uint8_t(*)[16]>(p + 2 * d)));
    return x;
  } else if constexpr (K == Entry::BF16 && AVX2) {
    v8 x;
    asm("vpmovzxwd %1, %0\n\tvpslld $16, %0, %0" : "=x"(x) : "m"(*reinterpret_cast<const uint8_t(*)[16]>(p + 2 * d)));
    return x;
  } else if constexpr (K == Entry::I8 && AVX2) {
    v8 x;
    asm("vpmovsxbd %1, %0\n\tvcvtdq2ps %0, %0" : "=x"(x) : "m"(*reinterpret_cast<const uint8_t(*)[8]>(p + d)));
    return x * scale;
  } else {
    float x[8];
    for (int i = 0; i < 8; ++i) x[i] = value<K>(p, d + i, scale);
    return load8(x);
  }
}

// A dot product of n values: 8 lanes summed over d in order, combined in a fixed order, the
// elements past the last 8 added after.
INLINE float combine(v8 a, float tail) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail; }

// dot(q_i, k) for M queries at once, each k element read once.
template <int M, Entry K, bool AVX2>
INLINE void dots_of(const float* const* qp, const uint8_t* k, int64_t n, float scale, float* out) {
  v8 lane[M];
  for (int i = 0; i < M; ++i) lane[i] = v8{};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const v8 kd = lanes<K, AVX2>(k, d, scale);
    for (int i = 0; i < M; ++i) lane[i] += load8(qp[i] + d) * kd;
  }
  for (int i = 0; i < M; ++i) {
    float tail = 0.0f;
    for (int64_t e = d; e < n; ++e) tail += qp[i][e] * value<K>(k, e, scale);
    out[i] = combine(lane[i], tail);
  }
}

template <Entry K, bool AVX2>
INLINE void dots(const float* const* qp, int64_t Q, const uint8_t* k, int64_t n, float* out) {
  const float scale = scale_of<K>(k, n);
  int64_t i = 0;
  for (; i + 4 <= Q; i += 4) dots_of<4, K, AVX2>(qp + i, k, n, scale, out + i);
  switch (Q - i) {
    case 3: dots_of<3, K, AVX2>(qp + i, k, n, scale, out + i); break;
    case 2: dots_of<2, K, AVX2>(qp + i, k, n, scale, out + i); break;
    case 1: dots_of<1, K, AVX2>(qp + i, k, n, scale, out + i); break;
    default: break;
  }
}

// max(row[0..n)) as std::max taken in order gives it, 8 lanes at a time: a max is the same
// whatever the order (a NaN is passed over as std::max(top, NaN) does; -0 and +0 may swap, which
// no exp(score - top) tells apart).
INLINE float highest(const float* row, int64_t n) {
  v8 lanes = v8{} - std::numeric_limits<float>::infinity();
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    const v8 x = load8(row + l);
    lanes = lanes < x ? x : lanes;
  }
  float top = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < 8; ++j) top = std::max(top, lanes[j]);
  for (; l < n; ++l) top = std::max(top, row[l]);
  return top;
}

// acc_i += p_i * v for the Q queries i (acc_i at acc + i * n, p_i = weights[i * S]), a query
// whose weight is 0 skipped; each v element read once for them all. Each acc element takes the
// same additions in the same order (position by position) as one query at a time would.
template <Entry K, bool AVX2>
INLINE void add_weighted(float* acc, const float* weights, int64_t S, int64_t Q, const uint8_t* v, int64_t n) {
  const float scale = scale_of<K>(v, n);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    const v8 vd = lanes<K, AVX2>(v, d, scale);
    for (int64_t i = 0; i < Q; ++i) {
      const float p = weights[i * S];
      if (p != 0.0f) store8(acc + i * n + d, load8(acc + i * n + d) + (v8{} + p) * vd);
    }
  }
  for (; d < n; ++d) {
    const float x = value<K>(v, d, scale);
    for (int64_t i = 0; i < Q; ++i) {
      const float p = weights[i * S];
      if (p != 0.0f) acc[i * n + d] += p * x;
    }
  }
}

struct Shapes {
  int64_t B, T, H, KV, G, D, L, N, W;  // W: an entry's bytes
};

// What a part of a (row, KV head) task leaves for `combine_parts`, per query i: the highest score
// it saw (m[i], -inf where it saw none), the sum of exp(score - m[i]) (sum[i]) and the sum of those
// weights times V (acc[i * D..], zeros to start with).
struct Partial {
  float* m;
  float* sum;
  float* acc;
};

// Each (row b, KV head h) task in PARTS parts: a row that sees SPLIT_FROM positions or more has
// them cut in halves by their count, so that one long row's three KV heads make six tasks for two
// threads, not three (a row's own count, never the batch's: a row's bits do not depend on its
// neighbours); a shorter row's second part is empty: at a few hundred positions a part's fixed
// costs are as large as what it shares (docs/bench-log.md, Dec 6 fourth session).
constexpr int64_t PARTS = 2, SPLIT_FROM = 256;

// What every task of one call reads: the queries, the pools, the rows' places and masks, and each
// row's seen positions.
struct Inputs {
  const Shapes& s;
  float scale;
  const float* q;
  const uint8_t *kp, *vp;
  const int64_t* read_at;
  const bool* mask;
  const std::vector<std::vector<int64_t>>& seen;
};

// Part `part` of the (row b, KV head h) task: its G*T queries over its share of the row's seen
// positions, on a pool of K entries. Query i = (g, t): head h * G + g, token t of row b; its
// pointer and its token's mask row worked out once.
template <Entry K, bool AVX2>
INLINE void attend_part(const Inputs& in, int64_t b, int64_t h, int64_t part, Partial out) {
  const Shapes& s = in.s;
  const float *q = in.q, scale = in.scale;
  const bool* mask = in.mask;
  const std::vector<int64_t>& seen = in.seen[b];
  const int64_t T = s.T, Q = s.G * T, D = s.D, L = s.L;
  std::vector<float> dot_out(Q);
  struct Query {
    const float* q;
    const bool* sees;  // its token's mask row
  };
  std::vector<Query> qs(Q);
  std::vector<const float*> qp(Q);  // the queries' vectors, as dots() takes them
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t t = i % T, at_q = ((b * T + t) * s.H + h * s.G + i / T) * D;
    qs[i] = {q + at_q, mask + (b * T + t) * L};
    qp[i] = qs[i].q;
  }
  const int64_t count = int64_t(seen.size()), half = count >= SPLIT_FROM ? (count + 1) / 2 : count;
  const int64_t first = part == 0 ? 0 : half, S = part == 0 ? half : count - half;
  if (S == 0) {  // an empty part (a short row's second, a padding row's): no weight anywhere
    std::fill(out.m, out.m + Q, -std::numeric_limits<float>::infinity());
    return;
  }
  const int64_t* mine = seen.data() + first;
  std::unique_ptr<float[]> scores(new float[Q * S]);  // [Q, S]: query i's score at mine[j]
  const int64_t* at = in.read_at + b * L;
  const uint8_t* kh = in.kp + h * s.N * s.W;
  const uint8_t* vh = in.vp + h * s.N * s.W;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < S; ++j) {
    const int64_t l = mine[j];
    bool all = true;
    for (int64_t t = 0; t < T; ++t) all &= qs[t].sees[l];
    dots<K, AVX2>(qp.data(), Q, kh + at[l] * s.W, D, dot_out.data());
    for (int64_t i = 0; i < Q; ++i) scores[i * S + j] = all || qs[i].sees[l] ? dot_out[i] * scale : minus_inf;
  }
  for (int64_t i = 0; i < Q; ++i) {  // each query's weights: exp(score - its highest here)
    float* row = scores.get() + i * S;
    const float top = highest(row, S);
    out.m[i] = top;
    out.sum[i] = 0.0f;
    if (top == minus_inf) {  // sees none of these: no weight on any
      std::fill(row, row + S, 0.0f);
      continue;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < S; ++j) {
      row[j] = row[j] == minus_inf ? 0.0f : std::exp(row[j] - top);
      sum += row[j];
    }
    out.sum[i] = sum;
  }
  for (int64_t j = 0; j < S; ++j) add_weighted<K, AVX2>(out.acc, scores.get() + j, S, Q, vh + at[mine[j]] * s.W, D);
}

template <bool AVX2>
INLINE void attend_kind(Entry kind, const Inputs& in, int64_t b, int64_t h, int64_t part, Partial out) {
  switch (kind) {
    case Entry::F32: attend_part<Entry::F32, AVX2>(in, b, h, part, out); break;
    case Entry::F16: attend_part<Entry::F16, AVX2>(in, b, h, part, out); break;
    case Entry::BF16: attend_part<Entry::BF16, AVX2>(in, b, h, part, out); break;
    case Entry::I8: attend_part<Entry::I8, AVX2>(in, b, h, part, out); break;
  }
}

// Built twice: for the baseline, and for AVX2 with F16C (every AVX2 CPU has it), picked at run
// time. Both do the same lane-wise products and sums (no fused multiply-add: FMA is not enabled,
// and -ffp-contract=off), so they give the same bits.
using Part = void (*)(Entry, const Inputs&, int64_t, int64_t, int64_t, Partial);
void attend_one(Entry kind, const Inputs& in, int64_t b, int64_t h, int64_t part, Partial out) {
  attend_kind<false>(kind, in, b, h, part, out);
}
#ifdef X86_AVX2
__attribute__((target("avx2,f16c"))) void attend_one_avx2(Entry kind, const Inputs& in, int64_t b, int64_t h,
                                                          int64_t part, Partial out) {
  attend_kind<true>(kind, in, b, h, part, out);
}
// STRATA_QUANTS_ISA=portable keeps the baseline build, so one machine can compare the two
Part pick_build() {
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && isa_cap() != "portable";
  return avx2 ? attend_one_avx2 : attend_one;
}
#else
Part pick_build() { return attend_one; }
#endif

// A (row, KV head) task's parts into its queries' outputs: each part's sums rescaled to the
// highest score of all, out = sum_p w_p acc_p / sum_p w_p sum_p, w_p = exp(m_p - m); zeros for a
// query that sees nothing (a padding row).
void combine_parts(const Shapes& s, int64_t b, int64_t h, const Partial* parts, float* out) {
  const int64_t T = s.T, Q = s.G * T, D = s.D;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < Q; ++i) {
    const int64_t t = i % T;
    float* o = out + ((b * T + t) * s.H + h * s.G + i / T) * D;
    float top = minus_inf;
    for (int64_t p = 0; p < PARTS; ++p) top = std::max(top, parts[p].m[i]);
    if (top == minus_inf) {
      std::memset(o, 0, sizeof(float) * D);
      continue;
    }
    float w[PARTS], total = 0.0f;
    for (int64_t p = 0; p < PARTS; ++p) {
      w[p] = parts[p].m[i] == minus_inf ? 0.0f : std::exp(parts[p].m[i] - top);
      total += w[p] * parts[p].sum[i];
    }
    for (int64_t d = 0; d < D; ++d) {
      float x = 0.0f;
      for (int64_t p = 0; p < PARTS; ++p) x += w[p] * parts[p].acc[i * D + d];
      o[d] = x / total;
    }
  }
}

// q [B, T, H, D] float32; k_pool, v_pool [KV, N, W] float32 / float16 / bfloat16 / int8 (W = D, or D + 4
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
    case at::kHalf: kind = Entry::F16, width = s.D; break;
    case at::kBFloat16: kind = Entry::BF16, width = s.D; break;
    case at::kChar: kind = Entry::I8, width = s.D + 4; break;
    default: TORCH_CHECK(false, "strata_attend::decode: a ", k_pool.scalar_type(), " pool (float32, float16, bfloat16 or int8)");
  }
  TORCH_CHECK(k_pool.size(2) == width, "strata_attend::decode: entries of ", k_pool.size(2), " elements for head_dim ", s.D);
  TORCH_CHECK(read_at.size(0) == s.B && mask.size(0) == s.B && mask.size(1) == s.T && mask.size(2) == s.L,
              "strata_attend::decode: read_at / mask do not match q's rows and tokens");
  // a plain loop, not read_at.min() and .max(): two reductions, each a parallel region of its
  // own, cost more than these few thousand integers (every layer of every decode step)
  const int64_t* at_ = read_at.data_ptr<int64_t>();
  bool inside = true;
  for (int64_t i = 0; i < read_at.numel(); ++i) inside &= at_[i] >= 0 && at_[i] < s.N;
  TORCH_CHECK(inside, "strata_attend::decode: read_at has places outside the pool's ", s.N);
  s.W = width * k_pool.element_size();
  at::Tensor out = at::empty({s.B, s.T, s.H * s.D}, q.options());
  const float* qs = q.data_ptr<float>();
  const uint8_t* kp = static_cast<const uint8_t*>(k_pool.data_ptr());
  const uint8_t* vp = static_cast<const uint8_t*>(v_pool.data_ptr());
  const bool* ms = mask.data_ptr<bool>();
  float* os = out.data_ptr<float>();
  // every part's partial sums: [B * KV * PARTS] x (Q highest scores, Q sums, Q * D weighted sums)
  const int64_t Q = s.G * s.T, tasks = s.B * s.KV * PARTS, per = Q * (2 + s.D);
  std::vector<float> partials(tasks * per);
  std::vector<Partial> parts(tasks);
  for (int64_t i = 0; i < tasks; ++i) {
    float* p = partials.data() + i * per;
    parts[i] = {p, p + Q, p + 2 * Q};
  }
  // each row's seen positions (any of its tokens sees them), found once for its KV heads and parts
  std::vector<std::vector<int64_t>> seen(s.B);
  for (int64_t b = 0; b < s.B; ++b) {
    seen[b].reserve(s.L);
    for (int64_t l = 0; l < s.L; ++l) {
      bool any = false;
      for (int64_t t = 0; t < s.T; ++t) any |= ms[(b * s.T + t) * s.L + l];
      if (any) seen[b].push_back(l);
    }
  }
  static const Part one = pick_build();
  const Inputs in{s, float(scale), qs, kp, vp, at_, ms, seen};
  at::parallel_for(0, tasks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t task = i / PARTS;
      one(kind, in, task / s.KV, task % s.KV, i % PARTS, parts[i]);
    }
  });
  for (int64_t task = 0; task < s.B * s.KV; ++task)
    combine_parts(s, task / s.KV, task % s.KV, parts.data() + task * PARTS, os);
  return out;
}

}  // namespace

TORCH_LIBRARY(strata_attend, m) {
  m.def("decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor read_at, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(strata_attend, CPU, m) { m.impl("decode", &decode); }
