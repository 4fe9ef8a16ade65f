// The (gated) delta rule's chunk forward on the CPU, one (sequence, head) per task.
//
// The algebra is that of fastweights/ops/delta_rule/chunk.py (the WY/UT form, Yang et al.
// 2024, arXiv:2406.06484); this file only changes where the work happens. The PyTorch path
// batches every chunk's products into small-tile `bmm` calls and moves the chunks through
// memory several times (gather, solve, scan, scatter). Here each task runs one head's
// chunks start to finish with its state and every per-chunk matrix in the core's own
// cache, and each product is one BLAS call on a whole tile (MKL's sgemm/dgemm reach the
// big-matmul rate at these tile sizes, where a batched `bmm` of them reaches about two
// thirds of it).
//
// Per chunk of C tokens (b = cumsum(g), Γ[r,i] = exp(b_r − b_i); all 1 without a gate):
//   S  = strictly-lower(K Kᵀ ⊙ Γ)           P = scale · lower(Q Kᵀ ⊙ Γ)
//   T  = (I + diag(β) S)⁻¹                    forward substitution, C³/6 multiply-adds
//   [W | U] = T diag(β) [K ⊙ e^b | V]
//   U' = U − W h                              O = scale · (Q ⊙ e^b) h + P U'
//   h ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ U'
//
// Batch invariance: a task copies its chunk into aligned scratch of fixed leading
// dimensions and every BLAS call runs single-threaded on that scratch, so a head's
// results do not depend on its neighbours, the batch size, the packing or the thread.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemm_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
int MKL_Set_Num_Threads_Local(int);  // MKL's C entry point (the lowercase name is the Fortran one)
}

namespace {

inline void blas_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                      const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                      const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void blas_gemm(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                      const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                      const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Row-major C[m×n] = alpha · op(A) op(B) + beta · C, with op(X) = Xᵀ when its flag is set.
// (Column-major BLAS sees the transposes: Cᵀ = op(B)ᵀ op(A)ᵀ.)
template <typename T>
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T beta, T* c, int64_t ldc) {
  const char opb = tb ? 'T' : 'N', opa = ta ? 'T' : 'N';
  const int m_ = int(m), n_ = int(n), k_ = int(k), lda_ = int(lda), ldb_ = int(ldb), ldc_ = int(ldc);
  blas_gemm(&opb, &opa, &n_, &m_, &k_, &alpha, b, &ldb_, a, &lda_, &beta, c, &ldc_);
}

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // keeps every scratch matrix 64-byte aligned

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

// The masks and decays of S = K Kᵀ and P = scale · Q Kᵀ (see masked_scores), in place.
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
    T* s = S + i * C;
    T* p = P + i * C;
    if (bcum != nullptr) {
      for (int64_t j = 0; j <= i; ++j) {
        const T gam = split ? up[i] * down[j] : std::exp(bcum[i] - bcum[j]);
        if (G != nullptr) G[i * C + j] = gam;
        p[j] *= gam;
        s[j] *= gam;
      }
    }
    std::fill(s + i, s + C, T(0));
    std::fill(p + i + 1, p + C, T(0));
  }
}

#if defined(__AVX512F__)
// The fp32 inverse below with each row held in (at most 8) zmm registers while it is summed: only
// the 16-wide blocks where T_i can be nonzero are touched, and a row is stored once.
inline bool unit_lower_inverse_avx512(int64_t C, const float* S, const float* beta, float* Tm) {
  if (C % 16 != 0 || C > 128) return false;
  const int64_t blocks = C / 16;
  for (int64_t r = 0; r < C; ++r) {
    __m512 acc[8];
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v) acc[v] = _mm512_setzero_ps();
    const float* s = S + r * C;
    const float minus_beta = -beta[r];
    for (int64_t i = 0; i < r; ++i) {
      const __m512 a = _mm512_set1_ps(minus_beta * s[i]);
      const float* ti = Tm + i * C;
      const int64_t live = i / 16 + 1;
#pragma GCC unroll 8
      for (int v = 0; v < 8; ++v)
        if (v < live) acc[v] = _mm512_fmadd_ps(a, _mm512_loadu_ps(ti + 16 * v), acc[v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < 8; ++v)
      if (v < blocks) _mm512_storeu_ps(Tm + r * C + 16 * v, acc[v]);
    Tm[r * C + r] = 1.f;
  }
  return true;
}
#endif

// Tm = (I + diag(β) S)⁻¹ for strictly lower S, row by row: T_r = e_r − β_r Σ_{i<r} S[r, i] T_i.
template <typename T>
void unit_lower_inverse(int64_t C, const T* S, const T* beta, T* Tm) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (unit_lower_inverse_avx512(C, S, beta, Tm)) return;
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
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
  }
}

// One head's inputs (q, k, v of element type E; β and g of type A) with their time strides, and
// the copy of a chunk of them into scratch: q → Q [C, K], k | v → KV [C, K + V], β → bvec, g →
// bcum; rows past the end are zeros (a no-op token for the rule). The next chunk's rows are
// prefetched meanwhile.
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

  void gather(int64_t t0, E* Q, E* KV, A* bvec, A* bcum) const {
    const int64_t rows = std::min(C, L - t0), KVw = K + V;
    if (t0 + C < L) {
      const int64_t next = std::min(C, L - t0 - C);
      prefetch_rows(q, q_t, t0 + C, next, K);
      prefetch_rows(k, k_t, t0 + C, next, K);
      prefetch_rows(v, v_t, t0 + C, next, V);
    }
    for (int64_t i = 0; i < C; ++i) {
      if (i < rows) {
        const int64_t t = t0 + i;
        std::memcpy(Q + i * K, q + t * q_t, sizeof(E) * K);
        std::memcpy(KV + i * KVw, k + t * k_t, sizeof(E) * K);
        std::memcpy(KV + i * KVw + K, v + t * v_t, sizeof(E) * V);
        bvec[i] = beta[t * beta_t];
        bcum[i] = g != nullptr ? g[t * g_t] : A(0);
      } else {
        std::fill(Q + i * K, Q + (i + 1) * K, E(0.f));
        std::fill(KV + i * KVw, KV + (i + 1) * KVw, E(0.f));
        bvec[i] = A(0);
        bcum[i] = A(0);
      }
    }
  }
};

template <typename T>
struct Forward {
  // inputs, head-first [N, H, T, ·] with unit stride in the last dim; strides (n, h, t) in elements
  const T *q, *k, *v, *beta, *g, *h0;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, g_s[3] = {};
  // outputs
  T* o;       // [N, NC·C, H, V] contiguous
  T* h_out;   // [N·H, K, V]
  T* states;  // [NC, N·H, K, V]: the state entering each chunk (keep only)
  T *q_flat, *kv_flat, *wu, *inverses;  // kept: [NC·N·H, C, K], [.., C, K+V], [.., C, K+V], [nb, NC·N·H, bs, bs]
  int64_t N, H, L, K, V, C, NC, nb;
  T scale;
  bool keep;

  int64_t scratch_size() const {
    return 2 * round16(C * (K + V)) + 3 * round16(C * C) + 2 * round16(C * V) + 3 * round16(C * K) +
           round16(K * V) + 4 * round16(C) + round16(C * (K + V));
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, KV = K + V, bs = C / nb, NH = N * H;
    T* Q = scratch;                  // [C, K]
    T* KVm = Q + round16(C * K);     // [C, K + V]: K | V
    T* R = KVm + round16(C * KV);    // [C, K + V]: diag(β) [K e^b | V]
    T* WU = R + round16(C * KV);     // [C, K + V]: [W | U], then [W | U']
    T* S = WU + round16(C * KV);     // [C, C]
    T* P = S + round16(C * C);       // [C, C]
    T* Tm = P + round16(C * C);      // [C, C]
    T* O = Tm + round16(C * C);      // [C, V]
    T* Qb = O + round16(C * V);      // [C, K]
    T* Kbar = Qb + round16(C * K);   // [C, K]
    T* h = Kbar + round16(C * K);    // [K, V]
    T* bvec = h + round16(K * V);    // [C] β
    T* bcum = bvec + round16(C);     // [C] b
    T* rd = bcum + round16(C);       // [C] e^b
    T* te = rd + round16(C);         // [C] e^{b_C − b}
    T* Up = WU + K;                  // U' lives in WU's V columns (leading dimension K + V)

    if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(T) * K * V);
    else std::fill(h, h + K * V, T(0));
    const auto in = HeadRows<T, T>::at(n, hh, q, q_s, k, k_s, v, v_s, beta, beta_s, g, g_s, L, K, V, C);
    const bool gated = g != nullptr;
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      in.gather(t0, Q, KVm, bvec, bcum);
      if (gated) chunk_decays(C, bcum, rd, te);
      masked_scores<T>(C, K, Q, K, KVm, KV, scale, gated ? bcum : nullptr, S, P, nullptr);
      unit_lower_inverse<T>(C, S, bvec, Tm);
      if (keep) {  // T's diagonal blocks are the inverses of the diagonal blocks of I + diag(β) S
        for (int64_t j = 0; j < nb; ++j) {
          T* dst = inverses + (j * NC * NH + row) * bs * bs;
          for (int64_t i = 0; i < bs; ++i) std::memcpy(dst + i * bs, Tm + (j * bs + i) * C + j * bs, sizeof(T) * bs);
        }
      }
      // [W | U] = T diag(β) [K e^b | V]
      for (int64_t i = 0; i < C; ++i) {
        const T bk = gated ? bvec[i] * rd[i] : bvec[i], bv = bvec[i];
        const T* src = KVm + i * KV;
        T* dst = R + i * KV;
        for (int64_t j = 0; j < K; ++j) dst[j] = bk * src[j];
        for (int64_t j = K; j < KV; ++j) dst[j] = bv * src[j];
      }
      mm<T>(false, false, C, KV, C, T(1), Tm, C, R, KV, T(0), WU, KV);
      // the state-dependent part: states[c] = h; U' = U − W h; O = scale · Q_b h + P U'; h ← e^{b_C} h + K̄ᵀ U'
      if (keep) std::memcpy(states + row * K * V, h, sizeof(T) * K * V);
      mm<T>(false, false, C, V, K, T(-1), WU, KV, h, V, T(1), Up, KV);
      const T* qread = Q;
      const T* kwrite = KVm;
      if (gated) {
        for (int64_t i = 0; i < C; ++i) {
          for (int64_t j = 0; j < K; ++j) {
            Qb[i * K + j] = Q[i * K + j] * rd[i];
            Kbar[i * K + j] = KVm[i * KV + j] * te[i];
          }
        }
        qread = Qb;
        kwrite = Kbar;
      }
      mm<T>(false, false, C, V, K, scale, qread, K, h, V, T(0), O, V);
      mm<T>(false, false, C, V, C, T(1), P, C, Up, KV, T(1), O, V);
      if (gated) {
        const T last = rd[C - 1];
        for (int64_t i = 0; i < K * V; ++i) h[i] *= last;
      }
      mm<T>(true, false, K, V, C, T(1), kwrite, gated ? K : KV, Up, KV, T(1), h, V);
      // outputs of the chunk
      for (int64_t i = 0; i < C; ++i) std::memcpy(o + ((n * NC * C + t0 + i) * H + hh) * V, O + i * V, sizeof(T) * V);
      if (keep) {
        std::memcpy(q_flat + row * C * K, Q, sizeof(T) * C * K);
        std::memcpy(kv_flat + row * C * KV, KVm, sizeof(T) * C * KV);
        std::memcpy(wu + row * C * KV, WU, sizeof(T) * C * KV);
      }
    }
    std::memcpy(h_out + nh * K * V, h, sizeof(T) * K * V);
  }
};

// The backward, one (sequence, head) per task, last chunk first (the derivation is
// fastweights/ops/delta_rule/README.md; the PyTorch path is chunk_delta_rule_bwd in chunk.py).
// Per chunk, from the forward's kept Q, [K | V], [W | U'] and entering state h, and dh = the
// gradient of the state leaving the chunk:
//   dU' = Pᵀ dO + K̄ dh                        dh_c = e^{b_C} dh + scale·Q_bᵀ dO − Wᵀ dU'
//   dP = dO U'ᵀ,  dQ_b = scale·dO hᵀ,  dK̄ = U' dhᵀ
//   dZ_U = Tᵀ dU',  −dZ_W = dZ_U hᵀ,  −dA = tril(dZ_U U'ᵀ, −1)      (T = (I + diag(β) S)⁻¹, recomputed)
//   dβ = Σ dZ_U ⊙ V − Σ (−dZ_W) ⊙ K_b − Σ (−dA) ⊙ S,  dV = β dZ_U
//   dQ = dQ_b ⊙ e^b + (dP ⊙ Γ·scale) K,  dK = dK̄ ⊙ e^{b_C−b} + (dP ⊙ Γ·scale)ᵀ Q − (D + Dᵀ) K − β (−dZ_W) ⊙ e^b
//   with D = strictly-lower(β (−dA)) ⊙ Γ, and the gate's db summed back into dg by a reverse cumsum.
template <typename T>
struct Backward {
  const T *q_flat, *kv_flat, *wu, *states, *beta, *g, *dout, *dh_final;
  int64_t beta_s[3] = {}, g_s[3] = {}, do_s[3] = {};
  T *dq, *dk, *dv, *dbeta, *dg, *dh0;  // [N, NC·C, H, ·] (dbeta, dg [N, NC·C, H]); dh0 [N·H, K, V]
  int64_t N, H, L, K, V, C, NC;
  T scale;

  int64_t scratch_size() const {
    return round16(C * K) * 9 + round16(C * V) * 4 + round16(C * C) * 7 + round16(K * V) * 2 + round16(C) * 6;
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, KV = K + V, NH = N * H;
    T* p = scratch;
    auto take = [&p](int64_t count) { T* out = p; p += round16(count); return out; };
    T *Qb = take(C * K), *Kbar = take(C * K), *Kb = take(C * K), *dQb = take(C * K), *dKbar = take(C * K);
    T *mdzw = take(C * K), *dqc = take(C * K), *dkc = take(C * K), *mdkb = take(C * K);
    T *dO = take(C * V), *dU = take(C * V), *dzu = take(C * V), *dvc = take(C * V);
    T *S = take(C * C), *P = take(C * C), *Tm = take(C * C), *dP = take(C * C), *mda = take(C * C);
    T *M = take(C * C), *G = take(C * C);
    T *dh = take(K * V), *dh_new = take(K * V);
    T *bvec = take(C), *bcum = take(C), *rd = take(C), *te = take(C), *db = take(C), *dbc = take(C);

    std::memcpy(dh, dh_final + nh * K * V, sizeof(T) * K * V);
    const T* bh = beta + n * beta_s[0] + hh * beta_s[1];
    const T* gh = g == nullptr ? nullptr : g + n * g_s[0] + hh * g_s[1];
    const T* doh = dout + n * do_s[0] + hh * do_s[1];
    const bool gated = gh != nullptr;

    for (int64_t c = NC - 1; c >= 0; --c) {
      const int64_t t0 = c * C, rows = std::min(C, L - t0), row = c * NH + nh;
      if (c > 0) prefetch_rows(doh, do_s[2], t0 - C, C, V);
      const T* Q = q_flat + row * C * K;
      const T* KVm = kv_flat + row * C * KV;
      const T* WU = wu + row * C * KV;  // [W | U']
      const T* Up = WU + K;
      const T* h = states + row * K * V;
      for (int64_t i = 0; i < C; ++i) {
        if (i < rows) {
          const int64_t t = t0 + i;
          std::memcpy(dO + i * V, doh + t * do_s[2], sizeof(T) * V);
          bvec[i] = bh[t * beta_s[2]];
          bcum[i] = gated ? gh[t * g_s[2]] : T(0);
        } else {
          std::fill(dO + i * V, dO + (i + 1) * V, T(0));
          bvec[i] = T(0);
          bcum[i] = T(0);
        }
      }
      const T* qread = Q;
      const T* kwrite = KVm;
      int64_t ld_kwrite = KV;
      T last = T(1);
      if (gated) {
        chunk_decays(C, bcum, rd, te);
        for (int64_t i = 0; i < C; ++i) {
          for (int64_t j = 0; j < K; ++j) {
            Qb[i * K + j] = Q[i * K + j] * rd[i];
            Kbar[i * K + j] = KVm[i * KV + j] * te[i];
            Kb[i * K + j] = KVm[i * KV + j] * rd[i];
          }
        }
        last = rd[C - 1];
        qread = Qb;
        kwrite = Kbar;
        ld_kwrite = K;
      }
      // S, P (with their masks and decays) and T = (I + diag(β) S)⁻¹, as in the forward
      masked_scores<T>(C, K, Q, K, KVm, KV, scale, gated ? bcum : nullptr, S, P, G);
      unit_lower_inverse<T>(C, S, bvec, Tm);
      // dU' = Pᵀ dO + K̄ dh
      mm<T>(true, false, C, V, C, T(1), P, C, dO, V, T(0), dU, V);
      mm<T>(false, false, C, V, K, T(1), kwrite, ld_kwrite, dh, V, T(1), dU, V);
      // dP = dO U'ᵀ; dQ_b = scale·dO hᵀ; dK̄ = U' dhᵀ; d_last = <h, dh>
      mm<T>(false, true, C, C, V, T(1), dO, V, Up, KV, T(0), dP, C);
      mm<T>(false, true, C, K, V, scale, dO, V, h, V, T(0), dQb, K);
      mm<T>(false, true, C, K, V, T(1), Up, KV, dh, V, T(0), dKbar, K);
      T d_last = T(0);
      if (gated) for (int64_t i = 0; i < K * V; ++i) d_last += h[i] * dh[i];
      // dh_c = e^{b_C} dh + scale·Q_bᵀ dO − Wᵀ dU'
      for (int64_t i = 0; i < K * V; ++i) dh_new[i] = last * dh[i];
      mm<T>(true, false, K, V, C, scale, qread, K, dO, V, T(1), dh_new, V);
      mm<T>(true, false, K, V, C, T(-1), WU, KV, dU, V, T(1), dh_new, V);
      // through the solve: dZ_U = Tᵀ dU'; −dZ_W = dZ_U hᵀ; −dA = tril(dZ_U U'ᵀ, −1)
      mm<T>(true, false, C, V, C, T(1), Tm, C, dU, V, T(0), dzu, V);
      mm<T>(false, true, C, K, V, T(1), dzu, V, h, V, T(0), mdzw, K);
      mm<T>(false, true, C, C, V, T(1), dzu, V, Up, KV, T(0), mda, C);
      for (int64_t i = 0; i < C; ++i) std::fill(mda + i * C + i, mda + (i + 1) * C, T(0));
      const T* kb = gated ? Kb : KVm;
      const int64_t ld_kb = gated ? K : KV;
      for (int64_t i = 0; i < C; ++i) {
        T acc = T(0);
        for (int64_t j = 0; j < V; ++j) acc += dzu[i * V + j] * KVm[i * KV + K + j];
        T acc_w = T(0);
        for (int64_t j = 0; j < K; ++j) acc_w += mdzw[i * K + j] * kb[i * ld_kb + j];
        T acc_a = T(0);
        for (int64_t j = 0; j < i; ++j) acc_a += mda[i * C + j] * S[i * C + j];
        dbc[i] = acc - acc_w - acc_a;  // dβ
        for (int64_t j = 0; j < V; ++j) dvc[i * V + j] = bvec[i] * dzu[i * V + j];
        for (int64_t j = 0; j < K; ++j) mdkb[i * K + j] = bvec[i] * mdzw[i * K + j];
        for (int64_t j = 0; j < i; ++j) mda[i * C + j] *= bvec[i];  // −dS = β (−dA)
        db[i] = gated ? -acc_w * bvec[i] : T(0);  // −Σ (−dK_b) ⊙ K_b
      }
      if (gated) {
        // −pair_grad((−dS) ⊙ S): db_r −= Σ_i E[r, i] − Σ_i E[i, r]
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < i; ++j) {
            const T e = mda[i * C + j] * S[i * C + j];
            db[i] -= e;
            db[j] += e;
          }
        // the shared read/write terms: (dQ_b ⊙ Q_b) − (dK̄ ⊙ K̄) + pair_grad(dP ⊙ P), and the chunk's end
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
      // d_qk = (dP ⊙ Γ) · scale on the causal triangle; M = D + Dᵀ with D = strictly-lower(−dS) ⊙ Γ
      for (int64_t i = 0; i < C; ++i) {
        for (int64_t j = 0; j < C; ++j) {
          T dpv = j <= i ? dP[i * C + j] * scale : T(0);
          if (gated && j <= i) dpv *= G[i * C + j];
          dP[i * C + j] = dpv;
        }
      }
      for (int64_t i = 0; i < C; ++i) {
        for (int64_t j = 0; j < C; ++j) {
          T d1 = j < i ? mda[i * C + j] : T(0);
          T d2 = i < j ? mda[j * C + i] : T(0);
          if (gated) {
            if (j < i) d1 *= G[i * C + j];
            if (i < j) d2 *= G[j * C + i];
          }
          M[i * C + j] = d1 + d2;
        }
      }
      // dQ = dQ_b ⊙ e^b + d_qk K;  dK = dK̄ ⊙ e^{b_C − b} + d_qkᵀ Q − M K − (−dK_b) ⊙ e^b
      for (int64_t i = 0; i < C; ++i) {
        const T fr = gated ? rd[i] : T(1), ft = gated ? te[i] : T(1);
        for (int64_t j = 0; j < K; ++j) {
          dqc[i * K + j] = dQb[i * K + j] * fr;
          dkc[i * K + j] = dKbar[i * K + j] * ft - mdkb[i * K + j] * fr;
        }
      }
      mm<T>(false, false, C, K, C, T(1), dP, C, KVm, KV, T(1), dqc, K);
      mm<T>(true, false, C, K, C, T(1), dP, C, Q, K, T(1), dkc, K);
      mm<T>(false, false, C, K, C, T(-1), M, C, KVm, KV, T(1), dkc, K);
      // write the chunk's gradients (rows past the end are padding: the buffers have NC·C rows)
      for (int64_t i = 0; i < C; ++i) {
        const int64_t o_row = (n * NC * C + t0 + i) * H + hh;
        std::memcpy(dq + o_row * K, dqc + i * K, sizeof(T) * K);
        std::memcpy(dk + o_row * K, dkc + i * K, sizeof(T) * K);
        std::memcpy(dv + o_row * V, dvc + i * V, sizeof(T) * V);
        dbeta[o_row] = dbc[i];
      }
      if (gated) {  // dg = reverse cumsum of db inside the chunk
        T run = T(0);
        for (int64_t i = C - 1; i >= 0; --i) {
          run += db[i];
          dg[(n * NC * C + t0 + i) * H + hh] = run;
        }
      }
      std::swap(dh, dh_new);
    }
    std::memcpy(dh0 + nh * K * V, dh, sizeof(T) * K * V);
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
    const int previous = MKL_Set_Num_Threads_Local(1);  // one core per head, whatever the caller's threads
    fastweights::cpu::Workspace scratch;
    T* base = static_cast<T*>(scratch.get(sizeof(T) * size_t(size)));
    for (int64_t nh = begin; nh < end; ++nh) work.head(nh, base);
    MKL_Set_Num_Threads_Local(previous);
  });
}

// The strides of a tensor's first three dims (n, h, t of [N, H, T, ·]; n, h, t of [N, H, T]).
void strides3(const torch::Tensor& t, int64_t* s) {
  for (int i = 0; i < 3; ++i) s[i] = t.stride(i);
}

template <typename T>
void run_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& beta,
                 const c10::optional<torch::Tensor>& g, const c10::optional<torch::Tensor>& h0, double scale,
                 int64_t C, int64_t nb, bool keep, torch::Tensor& o, torch::Tensor& h_out, torch::Tensor& states,
                 torch::Tensor& q_flat, torch::Tensor& kv_flat, torch::Tensor& wu, torch::Tensor& inverses) {
  Forward<T> f;
  f.q = q.data_ptr<T>();
  f.k = k.data_ptr<T>();
  f.v = v.data_ptr<T>();
  f.beta = beta.data_ptr<T>();
  f.g = g.has_value() ? g->data_ptr<T>() : nullptr;
  f.h0 = h0.has_value() ? h0->data_ptr<T>() : nullptr;
  strides3(q, f.q_s);
  strides3(k, f.k_s);
  strides3(v, f.v_s);
  strides3(beta, f.beta_s);
  if (g.has_value()) strides3(*g, f.g_s);
  f.o = o.data_ptr<T>();
  f.h_out = h_out.data_ptr<T>();
  f.states = keep ? states.data_ptr<T>() : nullptr;
  f.q_flat = keep ? q_flat.data_ptr<T>() : nullptr;
  f.kv_flat = keep ? kv_flat.data_ptr<T>() : nullptr;
  f.wu = keep ? wu.data_ptr<T>() : nullptr;
  f.inverses = keep ? inverses.data_ptr<T>() : nullptr;
  f.N = k.size(0);
  f.H = k.size(1);
  f.L = k.size(2);
  f.K = k.size(3);
  f.V = v.size(3);
  f.C = C;
  f.NC = (f.L + C - 1) / C;
  f.nb = nb;
  f.scale = T(scale);
  f.keep = keep;
  per_head(f);
}

// The forward with bf16 products (inference: nothing kept for a backward). Every product takes
// bf16 operands and accumulates in fp32 (gemm_bf16.h: AVX512-BF16's dot-product instruction where
// the CPU has it); the state, the decays, the triangular solve for T and every sum stay fp32, and
// an operand is rounded to bf16 once, right before its product: T and diag(β)[K e^b | V] for
// [W | U], W and h for U' = U − W h, Q e^b, h, P and U' for O, K̄ and U' for the state's update.
struct ForwardBf16 {
  using B16 = at::BFloat16;
  const B16 *q, *k, *v;
  const float *beta, *g, *h0;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, g_s[3] = {};
  B16* o;        // [N, NC·C, H, V]
  float* h_out;  // [N·H, K, V]
  int64_t N, H, L, K, V, C, NC;
  float scale;

  int64_t scratch_size() const {  // in floats; the bf16 buffers take half a float each, rounded up
    return round16(C * K) * 2 + round16(C * (K + V)) * 2 + round16(C * C) * 4 + round16(C * V) * 2 +
           round16(K * V) * 2 + round16(C) * 4;
  }

  void head(int64_t nh, float* scratch) const {
    const int64_t n = nh / H, hh = nh % H, KV = K + V;
    float* p = scratch;
    auto take = [&p](int64_t floats) { float* out = p; p += round16(floats); return out; };
    auto take16 = [&take](int64_t count) { return reinterpret_cast<B16*>(take((count + 1) / 2)); };
    B16* Qh = take16(C * K);     // Q, then Q e^b
    B16* KVh = take16(C * KV);   // K | V as given
    B16* Rh = take16(C * KV);    // diag(β) [K e^b | V]
    B16* Kbh = take16(C * K);    // K̄
    float* WU = take(C * KV);    // [W | U]
    float* S = take(C * C);
    float* P = take(C * C);
    float* Tm = take(C * C);
    B16* Th = take16(C * C);     // T, then P
    B16* Wh = take16(C * K);
    B16* Uph = take16(C * V);
    float* O = take(C * V);
    float* h = take(K * V);
    B16* hh16 = take16(K * V);
    float* Up = WU + K;          // U', in place of U (leading dimension K + V)
    float* bvec = take(C);
    float* bcum = take(C);
    float* rd = take(C);
    float* te = take(C);
    fastweights::cpu::Workspace ws;

    if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(float) * K * V);
    else std::fill(h, h + K * V, 0.f);
    const auto in = HeadRows<B16, float>::at(n, hh, q, q_s, k, k_s, v, v_s, beta, beta_s, g, g_s, L, K, V, C);
    const bool gated = g != nullptr;
    using fastweights::cpu::gemm_bf16;
    using fastweights::cpu::scale_to_bf16;
    using fastweights::cpu::to_bf16;

    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C;
      in.gather(t0, Qh, KVh, bvec, bcum);
      if (gated) chunk_decays(C, bcum, rd, te);
      gemm_bf16(false, true, C, C, K, 1.f, KVh, KV, KVh, KV, 0.f, S, C, ws);
      gemm_bf16(false, true, C, C, K, scale, Qh, K, KVh, KV, 0.f, P, C, ws);
      mask_scores<float>(C, gated ? bcum : nullptr, S, P, nullptr);
      unit_lower_inverse<float>(C, S, bvec, Tm);
      // [W | U] = T diag(β) [K e^b | V]
      for (int64_t i = 0; i < C; ++i) {
        scale_to_bf16(KVh + i * KV, gated ? bvec[i] * rd[i] : bvec[i], Rh + i * KV, K);
        scale_to_bf16(KVh + i * KV + K, bvec[i], Rh + i * KV + K, V);
      }
      to_bf16(Tm, Th, C * C);
      gemm_bf16(false, false, C, KV, C, 1.f, Th, C, Rh, KV, 0.f, WU, KV, ws);
      // U' = U − W h
      to_bf16(h, hh16, K * V);
      for (int64_t i = 0; i < C; ++i) to_bf16(WU + i * KV, Wh + i * K, K);
      gemm_bf16(false, false, C, V, K, -1.f, Wh, K, hh16, V, 1.f, Up, KV, ws);
      for (int64_t i = 0; i < C; ++i) to_bf16(Up + i * KV, Uph + i * V, V);
      // O = scale · (Q e^b) h + P U'
      if (gated) {
        for (int64_t i = 0; i < C; ++i) {
          scale_to_bf16(Qh + i * K, rd[i], Qh + i * K, K);
          scale_to_bf16(KVh + i * KV, te[i], Kbh + i * K, K);
        }
      }
      gemm_bf16(false, false, C, V, K, scale, Qh, K, hh16, V, 0.f, O, V, ws);
      to_bf16(P, Th, C * C);
      gemm_bf16(false, false, C, V, C, 1.f, Th, C, Uph, V, 1.f, O, V, ws);
      // h ← e^{b_C} h + K̄ᵀ U'
      if (gated) {
        const float last = rd[C - 1];
        for (int64_t i = 0; i < K * V; ++i) h[i] *= last;
      }
      gemm_bf16(true, false, K, V, C, 1.f, gated ? Kbh : KVh, gated ? K : KV, Uph, V, 1.f, h, V, ws);
      for (int64_t i = 0; i < C; ++i) to_bf16(O + i * V, o + ((n * NC * C + t0 + i) * H + hh) * V, V);
    }
    std::memcpy(h_out + nh * K * V, h, sizeof(float) * K * V);
  }
};

// The bf16-products forward: q, k, v bf16 [N, H, T, ·] (unit last stride), beta / g / h0 fp32.
// Returns (o [N, NC·C, H, V] bf16, h_T [N·H, K, V] fp32).
std::vector<torch::Tensor> chunk_delta_fwd_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                const torch::Tensor& beta, const c10::optional<torch::Tensor>& g,
                                                const c10::optional<torch::Tensor>& h0, double scale, int64_t C) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
              v.scalar_type() == torch::kBFloat16, "chunk_delta_fwd_bf16: q, k, v must be bfloat16");
  TORCH_CHECK(beta.scalar_type() == torch::kFloat && (!g.has_value() || g->scalar_type() == torch::kFloat) &&
              (!h0.has_value() || h0->scalar_type() == torch::kFloat), "chunk_delta_fwd_bf16: beta, g, h0 must be float32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "chunk_delta_fwd_bf16: last dims must be unit-stride");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  torch::Tensor o = torch::empty({N, NC * C, H, V}, v.options());
  torch::Tensor h_out = torch::empty({N * H, K, V}, beta.options());
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  ForwardBf16 f;
  f.q = q.data_ptr<at::BFloat16>();
  f.k = k.data_ptr<at::BFloat16>();
  f.v = v.data_ptr<at::BFloat16>();
  f.beta = beta.data_ptr<float>();
  f.g = g.has_value() ? g->data_ptr<float>() : nullptr;
  f.h0 = h0.has_value() ? h0c.data_ptr<float>() : nullptr;
  strides3(q, f.q_s);
  strides3(k, f.k_s);
  strides3(v, f.v_s);
  strides3(beta, f.beta_s);
  if (g.has_value()) strides3(*g, f.g_s);
  f.o = o.data_ptr<at::BFloat16>();
  f.h_out = h_out.data_ptr<float>();
  f.N = N; f.H = H; f.L = L; f.K = K; f.V = V; f.C = C; f.NC = NC;
  f.scale = float(scale);
  per_head(f);
  return {o, h_out};
}

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V], q_flat, kv_flat, wu, inverses);
// all but o and h_T are what the backward keeps, and empty unless keep.
std::vector<torch::Tensor> chunk_delta_fwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& beta, const c10::optional<torch::Tensor>& g,
                                           const c10::optional<torch::Tensor>& h0, double scale, int64_t C,
                                           int64_t nb, bool keep) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && beta.dim() == 3, "chunk_delta_fwd: bad ranks");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "chunk_delta_fwd: last dims must be unit-stride");
  TORCH_CHECK(C > 0 && nb > 0 && C % nb == 0, "chunk_delta_fwd: bad chunk size / row blocks");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  const int64_t rows = NC * N * H, bs = C / nb;
  auto opts = v.options();
  torch::Tensor o = torch::empty({N, NC * C, H, V}, opts);
  torch::Tensor h_out = torch::empty({N * H, K, V}, opts);
  torch::Tensor states, q_flat, kv_flat, wu, inverses;
  if (keep) {
    states = torch::empty({NC, N * H, K, V}, opts);
    q_flat = torch::empty({rows, C, K}, opts);
    kv_flat = torch::empty({rows, C, K + V}, opts);
    wu = torch::empty({rows, C, K + V}, opts);
    inverses = torch::empty({nb, rows, bs, bs}, opts);
  } else {
    states = q_flat = kv_flat = wu = inverses = torch::empty({0}, opts);
  }
  c10::optional<torch::Tensor> h0c;
  if (h0.has_value()) h0c = h0->contiguous();
  if (v.scalar_type() == torch::kFloat) {
    run_forward<float>(q, k, v, beta, g, h0c, scale, C, nb, keep, o, h_out, states, q_flat, kv_flat, wu, inverses);
  } else {
    TORCH_CHECK(v.scalar_type() == torch::kDouble, "chunk_delta_fwd: float32 or float64 only");
    run_forward<double>(q, k, v, beta, g, h0c, scale, C, nb, keep, o, h_out, states, q_flat, kv_flat, wu, inverses);
  }
  return {o, h_out, states, q_flat, kv_flat, wu, inverses};
}

// Returns (dq, dk, dv [N, NC·C, H, ·], dbeta, dg [N, NC·C, H] (dg empty without g), dh0 [N·H, K, V]).
std::vector<torch::Tensor> chunk_delta_bwd(const torch::Tensor& q_flat, const torch::Tensor& kv_flat,
                                           const torch::Tensor& wu, const torch::Tensor& states,
                                           const torch::Tensor& beta, const c10::optional<torch::Tensor>& g,
                                           const torch::Tensor& dout, const torch::Tensor& dh_final, double scale,
                                           int64_t C) {
  TORCH_CHECK(q_flat.is_contiguous() && kv_flat.is_contiguous() && wu.is_contiguous() && states.is_contiguous(),
              "chunk_delta_bwd: the kept tensors must be contiguous");
  TORCH_CHECK(dout.dim() == 4 && dout.stride(3) == 1 && beta.dim() == 3, "chunk_delta_bwd: bad do / beta");
  const int64_t N = beta.size(0), H = beta.size(1), L = beta.size(2), NC = states.size(0);
  const int64_t K = states.size(2), V = states.size(3);
  auto opts = states.options();
  torch::Tensor dq = torch::empty({N, NC * C, H, K}, opts), dk = torch::empty({N, NC * C, H, K}, opts);
  torch::Tensor dv = torch::empty({N, NC * C, H, V}, opts), dbeta = torch::empty({N, NC * C, H}, opts);
  torch::Tensor dg = g.has_value() ? torch::empty({N, NC * C, H}, opts) : torch::empty({0}, opts);
  torch::Tensor dh0 = torch::empty({N * H, K, V}, opts);
  torch::Tensor dhf = dh_final.contiguous();
  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Backward<T> b;
    b.q_flat = q_flat.data_ptr<T>();
    b.kv_flat = kv_flat.data_ptr<T>();
    b.wu = wu.data_ptr<T>();
    b.states = states.data_ptr<T>();
    b.beta = beta.data_ptr<T>();
    b.g = g.has_value() ? g->data_ptr<T>() : nullptr;
    b.dout = dout.data_ptr<T>();
    b.dh_final = dhf.data_ptr<T>();
    strides3(beta, b.beta_s);
    if (g.has_value()) strides3(*g, b.g_s);
    for (int i = 0; i < 3; ++i) b.do_s[i] = dout.stride(i);
    b.dq = dq.data_ptr<T>();
    b.dk = dk.data_ptr<T>();
    b.dv = dv.data_ptr<T>();
    b.dbeta = dbeta.data_ptr<T>();
    b.dg = g.has_value() ? dg.data_ptr<T>() : nullptr;
    b.dh0 = dh0.data_ptr<T>();
    b.N = N; b.H = H; b.L = L; b.K = K; b.V = V; b.C = C; b.NC = NC;
    b.scale = T(scale);
    per_head(b);
  };
  if (states.scalar_type() == torch::kFloat) fill(static_cast<float*>(nullptr));
  else {
    TORCH_CHECK(states.scalar_type() == torch::kDouble, "chunk_delta_bwd: float32 or float64 only");
    fill(static_cast<double*>(nullptr));
  }
  return {dq, dk, dv, dbeta, dg, dh0};
}

}  // namespace

void register_gemm_bf16(pybind11::module& m);   // gemm_bf16_check.cpp
void register_decode_step(pybind11::module& m);  // decode_step.cpp
void register_short_conv(pybind11::module& m);   // short_conv.cpp
void register_l2norm(pybind11::module& m);       // l2norm.cpp
void register_chunk_linear_attn(pybind11::module& m);  // chunk_linear_attn.cpp
void register_chunk_kda(pybind11::module& m);          // chunk_kda.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_delta_fwd", &chunk_delta_fwd, "the (gated) delta rule's chunk forward, one task per (sequence, head)");
  m.def("chunk_delta_fwd_bf16", &chunk_delta_fwd_bf16, "the inference forward with bf16 products");
  m.def("chunk_delta_bwd", &chunk_delta_bwd, "its backward, one task per (sequence, head), last chunk first");
  register_gemm_bf16(m);
  register_decode_step(m);
  register_short_conv(m);
  register_l2norm(m);
  register_chunk_linear_attn(m);
  register_chunk_kda(m);
}
