// The pieces the chunk kernels share (chunk_delta.cpp: fp32/fp64 forward and backward;
// chunk_delta_bf16.cpp: the bf16-products forward): the per-chunk masks, decays and triangular
// inverse, the gather of one head's chunk into scratch, and the per-head task loop. The algebra
// is fastweights/ops/delta_rule/chunk.py's (the WY/UT form, Yang et al. 2024, arXiv:2406.06484).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemm.h"
#include "gemm_bf16.h"
#include "isa.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <cstring>
#include <type_traits>

namespace fastweights {
namespace cpu {
namespace chunk {

// --- the per-chunk pieces the forward and the backward share ---------------------------

// b = cumsum(g) in place (bcum holds g on entry), e^b and e^{b_C − b}.
template <typename T>
void chunk_decays(int64_t C, T* bcum, T* rd, T* te) {
  for (int64_t i = 1; i < C; ++i) bcum[i] += bcum[i - 1];
  for (int64_t i = 0; i < C; ++i) {
    rd[i] = std::exp(bcum[i]);
    te[i] = std::exp(bcum[C - 1] - bcum[i]);
  }
}

// The gate's gradient through the state's reads and writes and through P (the terms the delta
// rule and linear attention share; db before the reverse cumsum inside the chunk), added to db:
//   db_r += Σ dQ_b ⊙ Q_b − Σ dK̄ ⊙ K̄ + Σ_i (dP ⊙ P)[r, i] − Σ_i (dP ⊙ P)[i, r],
//   db_C += Σ dK̄ ⊙ K̄ + e^{b_C} ⟨h, dh⟩   (last = e^{b_C}, d_last = ⟨h, dh⟩).
// Q_b, K̄ and their gradients are [C, K] rows, P and dP [C, C].
template <typename T>
void read_write_gate_grad(int64_t C, int64_t K, const T* Qb, const T* dQb, const T* Kbar, const T* dKbar, const T* P,
                          const T* dP, T last, T d_last, T* db) {
  T write_sum = T(0);
  for (int64_t i = 0; i < C; ++i) {
    T rq = T(0), wk = T(0);
    for (int64_t j = 0; j < K; ++j) {
      rq += dQb[i * K + j] * Qb[i * K + j];
      wk += dKbar[i * K + j] * Kbar[i * K + j];
    }
    db[i] += rq - wk;
    write_sum += wk;
  }
  for (int64_t i = 0; i < C; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      const T e = dP[i * C + j] * P[i * C + j];
      db[i] += e;
      db[j] -= e;
    }
  db[C - 1] += write_sum + d_last * last;
}

// S = strictly-lower(K Kᵀ ⊙ Γ) and P = scale · lower(Q Kᵀ ⊙ Γ), with Γ[i, j] = exp(b_i − b_j)
// (bcum == nullptr: no gate); the decays are also written into G (lower triangle) when given.
template <typename T>
void mask_scores(int64_t C, const T* bcum, T* S, T* P, T* G);

template <typename T>
void masked_scores(int64_t C, int64_t K, const T* Q, int64_t ldq, const T* Km, int64_t ldk, T scale,
                   const T* bcum, T* S, T* P, T* G) {
  mm<T>(false, true, C, C, K, T(1), Km, ldk, Km, ldk, T(0), S, C);
  mm<T>(false, true, C, C, K, scale, Q, ldq, Km, ldk, T(0), P, C);
  mask_scores(C, bcum, S, P, G);
}

// The masks and decays of S = K Kᵀ and P = scale · Q Kᵀ (see masked_scores), in place; S may be
// null (linear attention has no S). Without bcum, the masks only.
template <typename T>
void mask_scores(int64_t C, const T* bcum, T* S, T* P, T* G) {
  // Γ[i, j] = exp(b_i − b_j). With every |b| ≤ 60 in the chunk it is exp(b_i) · exp(−b_j) (2·C
  // exponentials instead of C²/2; no factor over- or underflows); otherwise the difference's.
  T up[512], down[512];
  bool split = bcum != nullptr && C <= 512;
  for (int64_t i = 0; split && i < C; ++i) split = std::abs(bcum[i]) <= T(60);
  if (split) {
    for (int64_t i = 0; i < C; ++i) {
      up[i] = std::exp(bcum[i]);
      down[i] = std::exp(-bcum[i]);
    }
  }
  for (int64_t i = 0; i < C; ++i) {
    T* s = S == nullptr ? nullptr : S + i * C;
    T* p = P + i * C;
    if (bcum != nullptr && split && G == nullptr) {  // the common case, in a loop the compiler vectorises
      const T ui = up[i];
      if (S != nullptr) {
#pragma omp simd
        for (int64_t j = 0; j <= i; ++j) {
          const T gam = ui * down[j];
          p[j] *= gam;
          s[j] *= gam;
        }
      } else {
#pragma omp simd
        for (int64_t j = 0; j <= i; ++j) p[j] *= ui * down[j];
      }
    } else if (bcum != nullptr) {
      for (int64_t j = 0; j <= i; ++j) {
        const T gam = split ? up[i] * down[j] : std::exp(bcum[i] - bcum[j]);
        if (G != nullptr) G[i * C + j] = gam;
        p[j] *= gam;
        if (S != nullptr) s[j] *= gam;
      }
    }
    if (S != nullptr) std::fill(s + i, s + C, T(0));
    std::fill(p + i + 1, p + C, T(0));
  }
}

#if defined(FASTWEIGHTS_VEC)
// The fp32 inverse below with each row held in (at most 8) vector registers while it is summed:
// only the blocks of Vec::kLanes where T_i can be nonzero are touched, and a row is stored once.
// C up to 8 blocks: 128 with AVX-512, 64 with AVX2 (whose 16 registers hold the 8 accumulators).
inline bool unit_lower_inverse_vec(int64_t C, const float* S, const float* beta, float* Tm) {
  constexpr int64_t W = Vec::kLanes;
  if (C % W != 0 || C > 8 * W) return false;
  const int64_t blocks = C / W;
  for (int64_t r = 0; r < C; ++r) {
    Vec::R acc[8];
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) acc[v] = Vec::zero();
    const float* s = S + r * C;
    const float minus_beta = -beta[r];
    for (int64_t i = 0; i < r; ++i) {
      const Vec::R a = Vec::set1(minus_beta * s[i]);
      const float* ti = Tm + i * C;
      const int64_t live = i / W + 1;
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v)
        if (v < live) acc[v] = Vec::fmadd(a, Vec::load(ti + W * v), acc[v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v)
      if (v < blocks) Vec::store(Tm + r * C + W * v, acc[v]);
    Tm[r * C + r] = 1.f;
  }
  return true;
}
#endif

// Tm = (I + diag(β) S)⁻¹ for strictly lower S, row by row: T_r = e_r − β_r Σ_{i<r} S[r, i] T_i.
template <typename T>
void unit_lower_inverse(int64_t C, const T* S, const T* beta, T* Tm) {
#if defined(FASTWEIGHTS_VEC)
  if constexpr (std::is_same_v<T, float>) {
    if (isa() > kPortable && unit_lower_inverse_vec(C, S, beta, Tm)) return;
  }
#endif
  std::fill(Tm, Tm + C * C, T(0));
  for (int64_t r = 0; r < C; ++r) {
    T* tr = Tm + r * C;
    const T* s = S + r * C;
    for (int64_t i = 0; i < r; ++i) {  // (T_i is zero past i: the loop runs to r, a bound the compiler vectorises)
      const T a = -beta[r] * s[i];
      const T* ti = Tm + i * C;
      for (int64_t j = 0; j < r; ++j) tr[j] += a * ti[j];
    }
    tr[r] = T(1);
  }
}

// Asks for the next chunk's input rows while this chunk computes: the rows are strided (one per
// token, H heads apart), so the hardware prefetcher does not follow them.
template <typename E>
inline void prefetch_rows(const E* base, int64_t stride, int64_t t0, int64_t rows, int64_t width) {
  const int64_t bytes = width * int64_t(sizeof(E));
  for (int64_t i = 0; i < rows; ++i) {
    const char* p = reinterpret_cast<const char*>(base + (t0 + i) * stride);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
}

// Whether any of x[0 .. n) is NaN or ±Inf (the exponent field all ones; fp32, fp64 or bf16): a
// min-reduction of the inverted exponent bits, zero only for such an entry, in a loop the compiler
// vectorises (bf16 two to a 32-bit word). The gather runs it over a chunk's dense rows once they
// are all copied, so it costs next to nothing where every entry is finite; count_nonfinite, the
// exact count, runs only where this says yes.
template <typename D>
inline bool any_nonfinite(const D* x, int64_t n) {
  if constexpr (sizeof(D) == 2) {  // bf16: the low and high halves of each word, in two minima
    const uint16_t* b = reinterpret_cast<const uint16_t*>(x);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(x);
    uint32_t lo = 0x7f80u, hi = 0x7f80u;
    const int64_t words = reinterpret_cast<uintptr_t>(x) % 4 == 0 ? n / 2 : 0;
#pragma omp simd reduction(min : lo, hi)
    for (int64_t j = 0; j < words; ++j) {
      const uint32_t t = ~w[j] & 0x7f807f80u;
      lo = std::min(lo, t & 0xffffu);
      hi = std::min(hi, t >> 16);
    }
    for (int64_t j = 2 * words; j < n; ++j) lo = std::min<uint32_t>(lo, ~uint32_t(b[j]) & 0x7f80u);
    return lo == 0 || hi == 0;
  } else {
    static_assert(std::is_same_v<D, float> || std::is_same_v<D, double>, "any_nonfinite: fp32, fp64 or bf16");
    using U = std::conditional_t<std::is_same_v<D, float>, uint32_t, uint64_t>;
    constexpr U E = std::is_same_v<D, float> ? U(0x7f800000u) : U(0x7ff0000000000000ull);
    const U* b = reinterpret_cast<const U*>(x);
    U low = E;
#pragma omp simd reduction(min : low)
    for (int64_t j = 0; j < n; ++j) low = std::min<U>(low, ~b[j] & E);
    return low == 0;
  }
}

// How many of x[0 .. n) are NaN or ±Inf.
template <typename D>
inline int64_t count_nonfinite(const D* x, int64_t n) {
  using U = std::conditional_t<sizeof(D) == 2, uint16_t, std::conditional_t<sizeof(D) == 4, uint32_t, uint64_t>>;
  const U E = sizeof(D) == 2 ? U(0x7f80u) : sizeof(D) == 4 ? U(0x7f800000u) : U(0x7ff0000000000000ull);
  const U* b = reinterpret_cast<const U*>(x);
  int64_t bad = 0;
  for (int64_t j = 0; j < n; ++j) bad += (b[j] & E) == E;
  return bad;
}

// How many NaN/±Inf entries `rows` rows of `width` entries, `ld` apart, hold (any_nonfinite per row;
// the exact count only for a row that has one). For kernels whose products read the rows where
// they lie: run once a chunk's products are done, while its rows are still in cache.
template <typename D>
inline int64_t rows_nonfinite(const D* x, int64_t ld, int64_t rows, int64_t width) {
  int64_t bad = 0;
  for (int64_t i = 0; i < rows; ++i)
    if (any_nonfinite(x + i * ld, width)) bad += count_nonfinite(x + i * ld, width);
  return bad;
}

// The ops' finite-input check of q, k and v, made by a kernel's gather (which reads every row
// anyway) instead of in separate passes over the inputs before the call: each task counts its
// rows' NaN/Inf entries, and the kernel raises the ops' ValueError (fastweights/ops/_checks.py's
// text, naming the op and the argument) once every task is done. An empty op name: no check.
struct FiniteCheck {
  std::string op;
  std::atomic<int64_t> bad[3] = {{0}, {0}, {0}};  // q, k, v

  explicit FiniteCheck(std::string op_name) : op(std::move(op_name)) {}
  bool on() const { return !op.empty(); }
  void add(const int64_t* counts) {
    for (int i = 0; i < 3; ++i)
      if (counts[i] != 0) bad[i].fetch_add(counts[i], std::memory_order_relaxed);
  }
  void raise_if_any() const {
    static const char* names[3] = {"q", "k", "v"};
    for (int i = 0; i < 3; ++i) {
      const int64_t n = bad[i].load();
      TORCH_CHECK_VALUE(n == 0, op, ": `", names[i], "` contains ", n,
                        " non-finite value(s) (NaN or Inf); they would poison the recurrent state. Clean the "
                        "input, or disable this check with fastweights.ops.finite_checks(False).");
    }
  }
};

// One head's inputs (q, k, v of element type E; β and g of type A) with their time strides, and
// the copy of a chunk of them into scratch: q → Q [C, K], k | v → KV [C, K + V], β → bvec, g →
// bcum; rows past the end are zeros (a no-op token for the rule). The next chunk's rows are
// prefetched meanwhile.
// n elements from src to dst: a copy, or bf16 widened to fp32 (exact) on the way.
template <typename E, typename D>
inline void copy_row(const E* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<E, D>) {
    std::memcpy(dst, src, sizeof(E) * n);
  } else {
    int64_t j = 0;
#if defined(FASTWEIGHTS_VEC)
    if constexpr (std::is_same_v<E, at::BFloat16> && std::is_same_v<D, float>) {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
      for (; j + Vec::kLanes <= n; j += Vec::kLanes) Vec::store(dst + j, Vec::load_bf16(bits + j));
    }
#endif
    for (; j < n; ++j) dst[j] = D(static_cast<float>(src[j]));
  }
}

// n fp32/fp64 results to an output row of type E: a copy, or rounded to bf16 (torch's rounding).
template <typename T, typename E>
inline void store_row(const T* src, E* dst, int64_t n) {
  if constexpr (std::is_same_v<E, T>) {
    std::memcpy(dst, src, sizeof(T) * n);
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<E, at::BFloat16>, "store_row: fp32 -> bf16 only");
    to_bf16(src, dst, n);
  }
}

template <typename E, typename A>
struct HeadRows {
  const E *q, *k, *v;
  const A *beta, *g;  // g == nullptr: no gate
  int64_t q_t, k_t, v_t, beta_t, g_t;
  int64_t L, K, V, C;

  // Head hh of sequence n of head-first [N, H, T, ·] tensors with strides (n, h, t) in elements.
  static HeadRows at(int64_t n, int64_t hh, const E* q, const int64_t* q_s, const E* k, const int64_t* k_s,
                     const E* v, const int64_t* v_s, const A* beta, const int64_t* beta_s, const A* g,
                     const int64_t* g_s, int64_t L, int64_t K, int64_t V, int64_t C) {
    return HeadRows{q + n * q_s[0] + hh * q_s[1], k + n * k_s[0] + hh * k_s[1], v + n * v_s[0] + hh * v_s[1],
                    beta + n * beta_s[0] + hh * beta_s[1], g == nullptr ? nullptr : g + n * g_s[0] + hh * g_s[1],
                    q_s[2], k_s[2], v_s[2], beta_s[2], g_s[2], L, K, V, C};
  }

  // Into scratch of type D: E itself, or fp32 for bf16 inputs (widened here, once per element).
  // Asks for part `part` of `parts` of the rows of the chunk at t0 (nothing past the end): a
  // kernel whose chunk is short work spreads the next chunk's requests over it (prefetch_ahead =
  // false in gather) instead of issuing them all at once, which stalls on the fill buffers.
  void prefetch_part(int64_t t0, int64_t part, int64_t parts) const {
    const int64_t rows = std::min(C, L - t0);
    if (rows <= 0) return;
    const int64_t begin = rows * part / parts, end = rows * (part + 1) / parts;
    prefetch_rows(q, q_t, t0 + begin, end - begin, K);
    prefetch_rows(k, k_t, t0 + begin, end - begin, K);
    prefetch_rows(v, v_t, t0 + begin, end - begin, V);
  }

  // bad (nullptr: no check): counts of q's, k's and v's non-finite entries, added to.
  template <typename D>
  void gather(int64_t t0, D* Q, D* KV, A* bvec, A* bcum, bool prefetch_ahead = true, int64_t* bad = nullptr) const {
    const int64_t rows = std::min(C, L - t0), KVw = K + V;
    if (prefetch_ahead) prefetch_part(t0 + C, 0, 1);
    for (int64_t i = 0; i < C; ++i) {
      if (i < rows) {
        const int64_t t = t0 + i;
        copy_row(q + t * q_t, Q + i * K, K);
        copy_row(k + t * k_t, KV + i * KVw, K);
        copy_row(v + t * v_t, KV + i * KVw + K, V);
        bvec[i] = beta[t * beta_t];
        bcum[i] = g != nullptr ? g[t * g_t] : A(0);
      } else {
        std::fill(Q + i * K, Q + (i + 1) * K, D(0.f));
        std::fill(KV + i * KVw, KV + (i + 1) * KVw, D(0.f));
        bvec[i] = A(0);
        bcum[i] = A(0);
      }
    }
    // the finite check, once every row is in (checked row by row in the loop above, its loads
    // would hold back the next rows' loads, which miss the cache on long inputs)
    if (bad != nullptr && rows > 0 && (any_nonfinite(Q, rows * K) || any_nonfinite(KV, rows * KVw))) {
      bad[0] += rows_nonfinite(Q, K, rows, K);
      bad[1] += rows_nonfinite(KV, KVw, rows, K);
      bad[2] += rows_nonfinite(KV + K, KVw, rows, V);
    }
  }
};

// Runs work.head(nh, scratch) for every (sequence, head), spread over torch's threads; each
// thread owns one 64-byte-aligned scratch block (gemm_bf16.h's Workspace: BLAS sees the same
// alignment for every head) and calls BLAS single-threaded.
template <typename Work>
void per_head(const Work& work) {
  using T = std::remove_cv_t<decltype(Work::scale)>;
  const int64_t tasks = work.N * work.H, size = work.scratch_size();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const OneThreadBlas one_core;  // one core per head, whatever the caller's threads
    Workspace scratch;
    T* base = static_cast<T*>(scratch.get(sizeof(T) * size_t(size)));
    for (int64_t nh = begin; nh < end; ++nh) work.head(nh, base);
  });
}

// Runs work.run(begin, end, scratch) on each thread's range of (sequence, head) tasks: per_head for
// kernels that work their tasks in groups of heads, chunk by chunk (one scratch block a thread,
// BLAS single-threaded).
template <typename Work>
void per_head_group(const Work& work) {
  using T = std::remove_cv_t<decltype(Work::scale)>;
  const int64_t size = work.scratch_size();
  at::parallel_for(0, work.N * work.H, 1, [&](int64_t begin, int64_t end) {
    const OneThreadBlas one_core;
    Workspace scratch;
    work.run(begin, end, static_cast<T*>(scratch.get(sizeof(T) * size_t(size))));
  });
}

// dst = factor · src for n entries of an output row that nothing reads again soon (gemm_bf16.h's
// to_bf16_scaled_stream for fp32 and fp64 rows): for fp32 above the portable level, where the row
// starts on a cache line and fills whole lines, non-temporal stores write it without first reading
// the lines in; else a plain loop (factor 1 copies exactly). The caller ends its run of such stores
// with store_fence().
template <typename T>
inline void store_scaled_stream(const T* src, T factor, T* dst, int64_t n) {
#if defined(FASTWEIGHTS_VEC)
  if constexpr (std::is_same_v<T, float>) {
    if (isa() > kPortable && n % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
      const Vec::R f = Vec::set1(factor);
      for (int64_t j = 0; j < n; j += Vec::kLanes) Vec::stream(dst + j, Vec::mul(Vec::load(src + j), f));
      return;
    }
  }
#endif
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] = factor * src[j];
}

// Runs run(T* tag) with T = float for a float32 `dtype` and double for float64 (the tag is a null
// pointer that carries the type); any other dtype is an error naming `op`.
template <typename Run>
void fp32_or_fp64(torch::ScalarType dtype, const char* op, Run&& run) {
  if (dtype == torch::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(dtype == torch::kDouble, op, ": float32 or float64 only");
    run(static_cast<double*>(nullptr));
  }
}

// The strides of a tensor's first three dims (n, h, t of [N, H, T, ·]; n, h, t of [N, H, T]).
inline void strides3(const torch::Tensor& t, int64_t* s) {
  for (int i = 0; i < 3; ++i) s[i] = t.stride(i);
}

// The sizes every chunk task carries (per_head reads N and H): N sequences of L tokens, H heads of
// K key and V value channels, NC chunks of C tokens. The kernels' work structs derive from it.
struct Grid {
  int64_t N = 0, H = 0, L = 0, K = 0, V = 0, C = 0, NC = 0;
};

// A head-first input's data, with the strides of its first three dims written into s; null (s
// untouched) for an absent optional input.
template <typename E>
inline const E* rows_of(const torch::Tensor& t, int64_t* s) {
  strides3(t, s);
  return t.data_ptr<E>();
}
template <typename E>
inline const E* rows_of(const c10::optional<torch::Tensor>& t, int64_t* s) {
  return t.has_value() ? rows_of<E>(*t, s) : nullptr;
}

// A tensor's data where `present` (what a kernel reads or writes only on request), else null.
template <typename E>
inline E* data_if(bool present, const torch::Tensor& t) {
  return present ? t.data_ptr<E>() : nullptr;
}

}  // namespace chunk
}  // namespace cpu
}  // namespace fastweights
