// Kimi Delta Attention's chunk forward and decode step on the CPU, one (sequence, head) per task.
//
// The algebra is fastweights/ops/kda/chunk.py's and kda/parallel.py's (Kimi Team 2025, "Kimi
// Linear", arXiv:2510.26692; the UT transform of Yang et al. 2024, arXiv:2406.06484). Per chunk
// of C tokens, with b = cumsum(gk) inside the chunk (one column per key channel):
//   S[r, i] = Σ_d k_r[d] k_i[d] e^{b_r[d] − b_i[d]} (i < r),  P = scale · the same with q_r (i ≤ r)
//   T = (I + diag(β) S)⁻¹,  [W | U] = T diag(β) [K ⊙ e^b | V]
//   U' = U − W h,  O = scale · (Q ⊙ e^b) h + P U',  h ← diag(e^{b_C}) h + (K ⊙ e^{b_C − b})ᵀ U'
//
// Where every channel's cumulative decay stays within e^{±60} over the chunk (e^{±600} in float64;
// the common case: a chunk of 64 tokens at −0.05 per token spans e^{−3}), S and P are one product
// over the whole chunk, [E ⊙ e^b ; Q_r] (K ⊙ e^{−b})ᵀ: no factor over- or underflows, each entry
// Σ_d x_r y_i e^{b_r} e^{−b_i} carries a few ulp per term as the relative form below does, and the
// chunk needs one exponential per element (e^b; e^{−b} = 1 / e^b, e^{b_C − b} = e^{b_C} e^{−b}).
// Otherwise S and P are computed in the relative form of kda/parallel.py, with the same reference points:
// rows in sub-blocks of s tokens, sub-block j measured from m = js − 1 (b_{−1} = 0), so the
// factors e^{b_r − b_m} of its rows and e^{b_m − b_i} of earlier columns are both ≤ 1 and
// nothing overflows however strong the decay. The earlier columns' factor is taken as
// e^{b_m − b_e(j')} · e^{b_e(j') − b_i}, e(j') the last token of the column's sub-block (two ≤ 1
// factors; C·K + nb²·K/2 exponentials instead of C²·K/(2s)). Pairs inside a sub-block are
// e^{b_r − b_m} · e^{b_m − b_i} when every channel decays by less than e^{±60} across the
// sub-block (the second factor ≥ 1 but finite: the whole row block is then one product),
// else summed exactly pair by pair. Each sub-block's rows of S and P are one BLAS call
// ([K ⊙ e_left ; scale · Q ⊙ e_left] against the columns' factors). The cumulative decays
// are summed in float64 and every exponential is taken of a float64 difference, rounded to the
// working precision only as a result (the PyTorch form rounds the exponent itself).
//
// The forward keeps the chunk-entry states; the backward recomputes the rest from the inputs.
//
// Gated DeltaNet-2 (ops/gdn2) runs on the same kernels: its step h ← (I − k eᵀ) diag(e^g) h + k xᵀ,
// with the erase key e = b ⊙ k and the written value x = w ⊙ v, is KDA's with e in the place of
// β k and x in the place of β v. Given `erase` (e) and no `beta` (β = 1), and x passed as v, every
// line above holds with e on the erase side (the rows of S, the left side of [W | U]) and k on
// the write side (the columns of S and P, the state's update Kᵀ U'); the backward then returns
// de beside dk. Without `erase` the kernels are KDA's, operation for operation.
#include "chunk_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace fastweights::cpu::chunk;

// Tm = (I + diag(β) S)⁻¹: chunk_common.h's unit_lower_inverse (the delta rule's, shared).

// One head's inputs (head-first [N, H, T, ·], unit last stride; beta [N, H, T]) with their time strides;
// beta null: β = 1; e (GDN-2's erase keys, [N, H, T, K]) null: the erase keys are k (KDA). E: the
// type of q, k, v — T, or bf16 (the inference forward's plain bf16 inputs, widened as gathered).
template <typename T, typename E = T>
struct HeadInputs {
  const E *q, *k, *v;
  const T *beta, *gk, *e;
  int64_t q_t, k_t, v_t, beta_t, gk_t, e_t;

  // Asks for the rows of the chunk at t0 (nothing past L or before 0) while another computes: one
  // token's rows are a page apart in a token-major input, which no hardware prefetcher follows.
  // Part `part` of `parts` of those rows: issued all at once, the requests of a whole chunk stall
  // on the fill buffers, so the kernels spread them over the chunk's work.
  void prefetch(int64_t t0, int64_t C, int64_t L, int64_t K, int64_t V, int64_t part = 0, int64_t parts = 1) const {
    if (t0 < 0 || t0 >= L) return;
    const int64_t rows = std::min(C, L - t0), begin = t0 + rows * part / parts, n = rows * (part + 1) / parts - rows * part / parts;
    prefetch_rows(q, q_t, begin, n, K);
    prefetch_rows(k, k_t, begin, n, K);
    prefetch_rows(v, v_t, begin, n, V);
    prefetch_rows(gk, gk_t, begin, n, K);
    if (e != nullptr) prefetch_rows(e, e_t, begin, n, K);
  }
};

// Every per-chunk quantity that does not need the state, in one task's scratch (the forward and the
// backward share it). `compute` takes chunk t0 of one head and leaves:
//   Q, Km, Vm, bvec: the gathered chunk (rows past the end zero); Em: the erase keys (Km itself for
//   KDA, GDN-2's e gathered otherwise); bd: b = cumsum(gk) in float64;
//   fac = e^b, Qr = scale · Q ⊙ e^b, Kw = K ⊙ e^{b_C − b}, last = e^{b_C}; `whole` (file comment) and,
//   where it holds, inv = e^{−b};
//   eleft[r] = e^{b_r − b_m(r)}, tosub[i] = e^{b_e(i) − b_i}, kr[i] = k_i ⊙ tosub[i] (the backward's,
//   and the forward's where not `whole`);
//   S, P (file comment; S's rows from Em), Tm = (I + diag(β) S)⁻¹, R = diag(β) [Em ⊙ e^b | V],
//   WU = Tm R.
template <typename T>
struct Terms {
  static constexpr int64_t kDoubles = int64_t(sizeof(double) / sizeof(T));  // T elements per double
  int64_t C, K, V, s;
  T scale;
  T *Q, *Km, *Vm, *eleft, *kr, *tosub, *inv, *LQ, *Qr, *Kw, *inside, *Right, *across, *fac, *gin, *erow, *Lf, *M, *S, *P,
      *Tm, *R, *WU, *bvec, *last, *Eg, *Em;
  double *bd, *ex, *exr;
  bool whole = false;  // this chunk's S and P by one product over the whole chunk (every |b| ≤ limit())

  static int64_t size(int64_t C, int64_t K, int64_t V, int64_t s) {
    const int64_t CK = round16(C * K);
    return 15 * CK + round16(C * V) + 2 * kDoubles * CK + kDoubles * round16(K) + round16(2 * s * K) +
           round16(2 * s * C) + 3 * round16(C * C) + 2 * round16(C * (K + V)) + round16(C) + round16(K) + CK;
  }

  Terms(Carve<T>& sc, int64_t C_, int64_t K_, int64_t V_, int64_t s_, T scale_)
      : C(C_), K(K_), V(V_), s(s_), scale(scale_) {
    Q = sc.take(C * K); Km = sc.take(C * K); Vm = sc.take(C * V);
    bd = reinterpret_cast<double*>(sc.take(kDoubles * C * K));
    ex = reinterpret_cast<double*>(sc.take(kDoubles * C * K));
    exr = reinterpret_cast<double*>(sc.take(kDoubles * K));
    eleft = sc.take(C * K); kr = sc.take(C * K); tosub = sc.take(C * K); Kw = sc.take(C * K);
    LQ = sc.take(2 * C * K); Qr = LQ + C * K;  // [E ⊙ e^b ; Q_r]
    inv = sc.take(C * K);  // e^{−b} (whole chunks only)
    inside = sc.take(C * K); Right = sc.take(C * K); across = sc.take(C * K); fac = sc.take(C * K);
    gin = sc.take(C * K); erow = sc.take(C * K);
    Lf = sc.take(2 * s * K); M = sc.take(2 * s * C);
    S = sc.take(2 * C * C); P = S + C * C; Tm = sc.take(C * C);  // S and P adjacent: one product fills both
    R = sc.take(C * (K + V)); WU = sc.take(C * (K + V)); bvec = sc.take(C); last = sc.take(K);
    Eg = sc.take(C * K);  // GDN-2's erase keys, gathered (Em points here or at Km)
    Em = Km;
  }

  double bm(int64_t m, int64_t d) const { return m < 0 ? 0.0 : bd[m * K + d]; }  // b_{−1} = 0

  // Right[i] = k_i ⊙ e^{b_m − b_i} for the columns i < js before sub-block j (m = js − 1), as
  // kr[i] ⊙ e^{b_m − b_e(j')}; the factors themselves into F when given.
  void right_before(int64_t j, T* F) {
    const int64_t m = j * s - 1;
    for (int64_t jp = 0; jp < j; ++jp) {
      const int64_t e = jp * s + s - 1;
      for (int64_t d = 0; d < K; ++d) exr[d] = bd[m * K + d] - bd[e * K + d];
      exp_of(exr, across, K);
      for (int64_t i = jp * s; i <= e; ++i)
        for (int64_t d = 0; d < K; ++d) {
          Right[i * K + d] = kr[i * K + d] * across[d];
          if (F != nullptr) F[i * K + d] = tosub[i * K + d] * across[d];
        }
    }
  }

  // e^{±limit} stays finite (and normal) in T: the bound on |b| for the whole-chunk products
  static constexpr double limit() { return std::is_same_v<T, float> ? 60.0 : 600.0; }

  // The sub-block factors: eleft[r] = e^{b_r − b_m(r)}, tosub[i] = e^{b_e(i) − b_i},
  // kr = K ⊙ tosub, and inside[i] = e^{b_m(i) − b_i} ≥ 1 (used only where finite).
  // From e^b and e^{−b} (`inv`) where the chunk is `whole` (every factor finite: products of two,
  // each to an ulp or two), else each its own exponential of a float64 difference.
  void sub_block_factors() {
    if (whole) {
      for (int64_t i = 0; i < C; ++i) {
        const int64_t m = (i / s) * s - 1, e = (i / s) * s + s - 1;
        const T *__restrict fi = fac + i * K, *__restrict ii = inv + i * K, *__restrict fe = fac + e * K,
                            *__restrict ki = Km + i * K;
        T *__restrict el = eleft + i * K, *__restrict in_ = inside + i * K, *__restrict ts = tosub + i * K,
                      *__restrict kk = kr + i * K;
        if (m < 0) {
          std::memcpy(el, fi, sizeof(T) * K);
          std::memcpy(in_, ii, sizeof(T) * K);
        } else {
          const T *__restrict fm = fac + m * K, *__restrict im = inv + m * K;
#pragma omp simd
          for (int64_t j = 0; j < K; ++j) {
            el[j] = fi[j] * im[j];
            in_[j] = fm[j] * ii[j];
          }
        }
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) {
          ts[j] = fe[j] * ii[j];
          kk[j] = ki[j] * ts[j];
        }
      }
      return;
    }
    for (int64_t i = 0; i < C; ++i) {
      const int64_t m = (i / s) * s - 1, e = (i / s) * s + s - 1;
      for (int64_t j = 0; j < K; ++j) ex[i * K + j] = bd[i * K + j] - bm(m, j);
      exp_of(ex + i * K, eleft + i * K, K);
      for (int64_t j = 0; j < K; ++j) exr[j] = bd[e * K + j] - bd[i * K + j];
      exp_of(exr, tosub + i * K, K);
      for (int64_t j = 0; j < K; ++j) {
        kr[i * K + j] = Km[i * K + j] * tosub[i * K + j];
        exr[j] = -ex[i * K + j];
      }
      exp_of(exr, inside + i * K, K);
    }
  }

  // S and P sub-block by sub-block (the file comment's relative form), from sub_block_factors'.
  void sub_block_products() {
    const int64_t nb = C / s;
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t r0 = j * s, m = r0 - 1;
      const T sc = scale;
      for (int64_t r = 0; r < s; ++r) {  // rows [E ⊙ e_left ; scale · Q ⊙ e_left]
        const T *__restrict el = eleft + (r0 + r) * K, *__restrict er = Em + (r0 + r) * K,
                            *__restrict qr = Q + (r0 + r) * K;
        T *__restrict le = Lf + r * K, *__restrict lq = Lf + (s + r) * K;
#pragma omp simd
        for (int64_t d = 0; d < K; ++d) {
          le[d] = er[d] * el[d];
          lq[d] = qr[d] * el[d] * sc;
        }
      }
      right_before(j, nullptr);
      // the sub-block's own pairs by the split factors when every channel stays finite (one
      // reduction the compiler vectorises: the decay's span from the reference point, at most)
      double span = 0.0;
      for (int64_t i = r0; i < r0 + s; ++i) {
        const double* bi = bd + i * K;
#pragma omp simd reduction(max : span)
        for (int64_t d = 0; d < K; ++d) span = std::max(span, std::abs((m < 0 ? 0.0 : bd[m * K + d]) - bi[d]));
      }
      const bool split = span <= limit();
      const int64_t cols = split ? r0 + s : r0;
      if (split)
        for (int64_t i = r0; i < r0 + s; ++i)
          for (int64_t d = 0; d < K; ++d) Right[i * K + d] = Km[i * K + d] * inside[i * K + d];
      if (cols > 0) mm<T>(false, true, 2 * s, cols, K, T(1), Lf, K, Right, K, T(0), M, C);
      for (int64_t r = 0; r < s; ++r) {
        const int64_t rr = r0 + r;
        std::memcpy(S + rr * C, M + r * C, sizeof(T) * r0);
        std::memcpy(P + rr * C, M + (s + r) * C, sizeof(T) * r0);
        for (int64_t i = r0; i <= rr; ++i) {
          T sv, pv;
          if (split) {
            sv = M[r * C + i];
            pv = M[(s + r) * C + i];
          } else {  // exactly: Σ_d x_r y_i e^{b_r − b_i} (x = e or q, y = k)
            for (int64_t d = 0; d < K; ++d) exr[d] = bd[rr * K + d] - bd[i * K + d];
            exp_of(exr, across, K);
            sv = pv = T(0);
            for (int64_t d = 0; d < K; ++d) {
              const T ky = Km[i * K + d] * across[d];
              sv += Em[rr * K + d] * ky;
              pv += Q[rr * K + d] * ky;
            }
            pv *= scale;
          }
          S[rr * C + i] = i < rr ? sv : T(0);
          P[rr * C + i] = pv;
        }
        std::fill(S + rr * C + rr + 1, S + (rr + 1) * C, T(0));
        std::fill(P + rr * C + rr + 1, P + (rr + 1) * C, T(0));
      }
    }
  }

  // The chunk's terms (the struct comment). `factors`: also the sub-block factors (eleft, tosub,
  // kr, inside) that the backward's adjoint of S and P reads; the forward asks for them only when
  // the chunk takes the sub-block path.
  template <typename E>
  void compute(const HeadInputs<T, E>& in, int64_t t0, int64_t L, bool factors) {
    const int64_t KV = K + V;
    gather_rows(in.q, in.q_t, t0, L, C, K, Q, K);
    gather_rows(in.k, in.k_t, t0, L, C, K, Km, K);
    gather_rows(in.v, in.v_t, t0, L, C, V, Vm, V);
    gather_rows(in.gk, in.gk_t, t0, L, C, K, gin, K);
    Em = Km;
    if (in.e != nullptr) {
      gather_rows(in.e, in.e_t, t0, L, C, K, Eg, K);
      Em = Eg;
    }
    for (int64_t i = 0; i < C; ++i)
      bvec[i] = t0 + i < L ? (in.beta != nullptr ? in.beta[(t0 + i) * in.beta_t] : T(1)) : T(0);
    // b = cumsum(gk) in float64, and its largest magnitude over the chunk (one vectorised reduction)
    double high = 0.0;
    for (int64_t j = 0; j < K; ++j) bd[j] = double(gin[j]);
    for (int64_t i = 1; i < C; ++i) {
      double* bi = bd + i * K;
      const double* bp = bi - K;
      const T* gi = gin + i * K;
#pragma omp simd
      for (int64_t j = 0; j < K; ++j) bi[j] = bp[j] + double(gi[j]);
    }
#pragma omp simd reduction(max : high)
    for (int64_t i = 0; i < C * K; ++i) high = std::max(high, std::abs(bd[i]));
    whole = high <= limit();
    exp_of(bd, fac, C * K);  // e^b (the state's reads)
    std::memcpy(last, fac + (C - 1) * K, sizeof(T) * K);
    T* EF = LQ;  // [E ⊙ e^b ; scale · Q ⊙ e^b] (Qr = its lower half)
    if (whole) {
      // every |b| ≤ limit: e^{−b} = 1 / e^b is finite, and e^{b_C − b} = e^{b_C} · e^{−b} (a product
      // of two finite factors, each to an ulp or two)
      for (int64_t i = 0; i < C; ++i) {
        const T* __restrict f = fac + i * K;
        const T *__restrict qi = Q + i * K, *__restrict ki = Km + i * K, *__restrict ei = Em + i * K;
        const T* __restrict lst = last;
        T *__restrict er = erow + i * K, *__restrict rt = Right + i * K, *__restrict ef = EF + i * K,
                      *__restrict qr = Qr + i * K, *__restrict kw = Kw + i * K, *__restrict iv = inv + i * K;
        const T sc = scale;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) {
          iv[j] = T(1) / f[j];
          er[j] = lst[j] * iv[j];
          rt[j] = ki[j] * iv[j];
          ef[j] = ei[j] * f[j];
          qr[j] = qi[j] * f[j] * sc;
          kw[j] = ki[j] * er[j];
        }
      }
    } else {
      const double* bC = bd + (C - 1) * K;
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < K; ++j) ex[i * K + j] = bC[j] - bd[i * K + j];
      exp_of(ex, erow, C * K);  // e^{b_C − b} (the state's writes)
      for (int64_t i = 0; i < C * K; ++i) {
        EF[i] = Em[i] * fac[i];
        Qr[i] = Q[i] * fac[i] * scale;
        Kw[i] = Km[i] * erow[i];
      }
    }
    for (int64_t i = 0; i < C; ++i) {
      const T bi = bvec[i];
      for (int64_t j = 0; j < K; ++j) R[i * KV + j] = bi * EF[i * K + j];
      for (int64_t j = 0; j < V; ++j) R[i * KV + K + j] = bi * Vm[i * V + j];
    }
    if (factors || !whole) sub_block_factors();
    if (whole) {
      // S and P in one product over the whole chunk: [E ⊙ e^b ; Q_r] (K ⊙ e^{−b})ᵀ, the rows of S
      // then those of P (S and P are adjacent), each entry Σ_d x_r y_i e^{b_r − b_i} with factors
      // that neither overflow nor underflow; then the masks.
      mm<T>(false, true, 2 * C, C, K, T(1), EF, K, Right, K, T(0), S, C);
      for (int64_t r = 0; r < C; ++r) {
        std::fill(S + r * C + r, S + (r + 1) * C, T(0));
        std::fill(P + r * C + r + 1, P + (r + 1) * C, T(0));
      }
    } else {
      sub_block_products();
    }
    unit_lower_inverse<T>(C, S, bvec, Tm);
    mm<T>(false, false, C, KV, C, T(1), Tm, C, R, KV, T(0), WU, KV);  // [W | U] = T R
  }
};

// The kernels' inputs as the tensors give them (head-first [N, H, T, ·], unit last stride; beta
// [N, H, T]) with their strides; beta and e null where absent. The forward and the backward bind
// them alike (`bind`) and take one head's rows from them (`head_rows`). E: q's, k's and v's type
// (HeadInputs).
template <typename T, typename E = T>
struct KdaInputs {
  const E *q, *k, *v;
  const T *beta, *gk, *e;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, gk_s[3] = {}, e_s[3] = {};

  void bind(const torch::Tensor& q_, const torch::Tensor& k_, const torch::Tensor& v_,
            const c10::optional<torch::Tensor>& beta_, const torch::Tensor& gk_,
            const c10::optional<torch::Tensor>& e_) {
    q = rows_of<E>(q_, q_s);
    k = rows_of<E>(k_, k_s);
    v = rows_of<E>(v_, v_s);
    beta = rows_of<T>(beta_, beta_s);
    gk = rows_of<T>(gk_, gk_s);
    e = rows_of<T>(e_, e_s);
  }

  HeadInputs<T, E> head_rows(int64_t n, int64_t hh) const {
    return HeadInputs<T, E>{q + n * q_s[0] + hh * q_s[1], k + n * k_s[0] + hh * k_s[1], v + n * v_s[0] + hh * v_s[1],
                         beta == nullptr ? nullptr : beta + n * beta_s[0] + hh * beta_s[1],
                         gk + n * gk_s[0] + hh * gk_s[1], e == nullptr ? nullptr : e + n * e_s[0] + hh * e_s[1],
                         q_s[2], k_s[2], v_s[2], beta_s[2], gk_s[2], e_s[2]};
  }
};

// The forward also makes the ops' input checks on the rows each chunk gathers anyway (in cache), in
// place of the front end's passes over the inputs: q, k, v finite (chunk_common.h's FiniteCheck,
// which raises the ops' ValueError), and for the log decay gk, per task, its non-finite and NaN
// counts and its largest entry NaN aside (decay_stats [N·H, 3], float64; Python raises the ops'
// messages from them, fastweights/ops/_checks.py's check_decay_stats).
// E: the type of q, k, v and o — T, or bf16 (inference only, T = float: the rows widened as they
// are gathered, each chunk's output computed in fp32 scratch and rounded once as it is written, as
// torch's .to(bfloat16) rounds; the arithmetic is the fp32 kernel's on the widened inputs).
template <typename T, typename E = T>
struct Forward : Grid, KdaInputs<T, E> {
  using In = KdaInputs<T, E>;
  using In::q, In::k, In::v, In::beta, In::gk, In::e;
  static constexpr bool kWiden = !std::is_same_v<T, E>;
  const T* h0;
  E* o;                                 // [N, NC·C, H, V]
  T *h_out, *states;                    // [N·H, K, V], [NC, N·H, K, V] (keep only)
  int64_t s;                            // the sub-block size (C a multiple of it)
  T scale;
  bool keep;
  FiniteCheck* finite;                  // q, k, v (off: an empty op name)
  double* decay_stats;                  // [N·H, 3] or null (no check of gk)

  int64_t scratch_size() const { return Terms<T>::size(C, K, V, s) + round16(K * V) + (kWiden ? round16(C * V) : 0); }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H, KV = K + V, ldo = H * V;
    Carve<T> sc{scratch};
    Terms<T> x(sc, C, K, V, s, scale);
    T* h = sc.take(K * V);
    T* Ob = kWiden ? sc.take(C * V) : nullptr;  // the chunk's fp32 output, before it is rounded (bf16 only)
    T* Up = x.WU + K;  // U' in place of U
    const auto in = this->head_rows(n, hh);
    if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(T) * K * V);
    else std::fill(h, h + K * V, T(0));
    int64_t decay_bad = 0, decay_nan = 0;
    T decay_high = -std::numeric_limits<T>::infinity();
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      in.prefetch(t0 + C, C, L, K, V, 0, 4);  // the next chunk's rows, in four parts over this one's work
      x.compute(in, t0, L, false);
      in.prefetch(t0 + C, C, L, K, V, 1, 4);
      const int64_t rows = std::min(C, L - t0);
      if (finite->on() && (any_nonfinite(x.Q, rows * K) || any_nonfinite(x.Km, rows * K) ||
                           any_nonfinite(x.Vm, rows * V))) {
        const int64_t bad[3] = {count_nonfinite(x.Q, rows * K), count_nonfinite(x.Km, rows * K),
                                count_nonfinite(x.Vm, rows * V)};
        finite->add(bad);
      }
      if (decay_stats != nullptr) {
        const T* gin = x.gin;
        if (any_nonfinite(gin, rows * K))
          for (int64_t i = 0; i < rows * K; ++i) {
            decay_bad += !std::isfinite(gin[i]);
            decay_nan += std::isnan(gin[i]);
          }
        // the largest entry, as one vectorised reduction (what it makes of a NaN does not matter:
        // with any NaN the check reads the largest entry as NaN, as amax gives it)
        T high = decay_high;
#pragma omp simd reduction(max : high)
        for (int64_t i = 0; i < rows * K; ++i) high = gin[i] > high ? gin[i] : high;
        decay_high = high;
      }
      // U' = U − W h;  O = Q_r h + P U' (straight into the token-major output);  h ← diag(e^{b_C}) h + K_wᵀ U'
      if (keep) store_scaled_stream(h, T(1), states + row * K * V, K * V);  // read only by the backward
      T* O;
      int64_t ld;
      if constexpr (kWiden) {
        O = Ob;
        ld = V;
      } else {
        O = o + (n * NC * C + t0) * ldo + hh * V;
        ld = ldo;
      }
      mm<T>(false, false, C, V, K, T(-1), x.WU, KV, h, V, T(1), Up, KV);
      in.prefetch(t0 + C, C, L, K, V, 2, 4);
      mm<T>(false, false, C, V, K, T(1), x.Qr, K, h, V, T(0), O, ld);
      mm<T>(false, false, C, V, C, T(1), x.P, C, Up, KV, T(1), O, ld);
      if constexpr (kWiden)
        for (int64_t i = 0; i < C; ++i) store_row(O + i * V, o + (n * NC * C + t0 + i) * ldo + hh * V, V);
      in.prefetch(t0 + C, C, L, K, V, 3, 4);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) h[i * V + j] *= x.last[i];
      mm<T>(true, false, K, V, C, T(1), x.Kw, K, Up, KV, T(1), h, V);
    }
    std::memcpy(h_out + nh * K * V, h, sizeof(T) * K * V);
    if (keep) fastweights::cpu::store_fence();  // the streamed states visible before the task ends
    if (decay_stats != nullptr) {
      decay_stats[3 * nh] = double(decay_bad);
      decay_stats[3 * nh + 1] = double(decay_nan);
      decay_stats[3 * nh + 2] = double(decay_high);
    }
  }
};

// The backward, one (sequence, head) per task, last chunk first: the adjoint of the loop
// (kda/chunk.py's chunk_kda_bwd) and of the state-free terms (kda/parallel.py's
// block_terms_backward and RelativeDecay.products_backward) per chunk, from the inputs and the
// chunk-entry states, everything else recomputed. Per chunk, with dh the gradient of the state
// leaving it:
//   dU' = Pᵀ dO + K_w dh,   dh_c = diag(e^{b_C}) dh + Q_rᵀ dO − Wᵀ dU'
//   dZ = Tᵀ [−dU' hᵀ | dU'],  dA = −tril(dZ [W | U]ᵀ, −1),  dR = diag(β) dZ,  dS = diag(β) dA
//   dβ = Σ dZ ⊙ [K ⊙ e^b | V] + Σ dA ⊙ S
// and S, P's adjoints in the relative form: across sub-blocks one BLAS call each way per sub-block
// (dLeft = dM Right, dRight = dMᵀ Left), inside a sub-block pair by pair. Every gk_t gradient is
// a sum over the spans of the factors that hold it (never a difference of cumulative sums).
// With GDN-2's erase keys E (file comment): β = 1 (no dβ), and what the erase side of S and of
// [W | U] pulls goes to dE instead of dK.
template <typename T>
struct Backward : Grid, KdaInputs<T> {
  using KdaInputs<T>::q, KdaInputs<T>::k, KdaInputs<T>::v, KdaInputs<T>::beta, KdaInputs<T>::gk, KdaInputs<T>::e;
  const T *states, *dout, *dh_final;
  int64_t do_s[3] = {};
  T *dq, *dk, *dv, *dbeta, *dgk, *de, *dh0;  // [N, NC·C, H, ·] (dbeta [N, NC·C, H]); dh0 [N·H, K, V]
  int64_t s;
  T scale;

  int64_t scratch_size() const {
    const int64_t CK = round16(C * K), KV = K + V;
    return Terms<T>::size(C, K, V, s) + 3 * round16(C * V) + 2 * round16(C * KV) + 2 * round16(C * C) + 8 * CK +
           2 * round16(K * V) + round16(2 * s * K) + round16(2 * s * C) + round16(s * s * K) + round16(C) + round16(K) + CK;
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H, KV = K + V, nb = C / s;
    Carve<T> sc{scratch};
    Terms<T> x(sc, C, K, V, s, scale);
    T *dO = sc.take(C * V), *du = sc.take(C * V), *Up = sc.take(C * V), *dwu = sc.take(C * KV), *dz = sc.take(C * KV);
    T *dA = sc.take(C * C), *dP = sc.take(C * C);
    T *dqc = sc.take(C * K), *dkc = sc.take(C * K), *dgc = sc.take(C * K), *dQr = sc.take(C * K), *dKw = sc.take(C * K);
    T *F = sc.take(C * K), *dR = sc.take(C * K), *span = sc.take(C * K);
    T *dh = sc.take(K * V), *dh_new = sc.take(K * V), *dL = sc.take(2 * s * K), *dM = sc.take(2 * s * C);
    T *Z = sc.take(s * s * K), *dbc = sc.take(C), *run = sc.take(K);
    T* dec = e != nullptr ? sc.take(C * K) : dkc;  // the erase keys' gradient: dK itself for KDA
    const auto in = this->head_rows(n, hh);
    const T* doh = dout + n * do_s[0] + hh * do_s[1];
    std::memcpy(dh, dh_final + nh * K * V, sizeof(T) * K * V);
    for (int64_t c = NC - 1; c >= 0; --c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      const T* h = states + row * K * V;
      in.prefetch(t0 - C, C, L, K, V, 0, 2);  // the previous chunk's rows, spread over this one's work
      x.compute(in, t0, L, true);
      in.prefetch(t0 - C, C, L, K, V, 1, 2);
      gather_rows(doh, do_s[2], t0, L, C, V, dO, V);
      // U' = U − W h
      for (int64_t i = 0; i < C; ++i) std::memcpy(Up + i * V, x.WU + i * KV + K, sizeof(T) * V);
      mm<T>(false, false, C, V, K, T(-1), x.WU, KV, h, V, T(1), Up, V);
      // the loop's adjoint: dU' = Pᵀ dO + K_w dh;  dh_c = diag(e^{b_C}) dh + Q_rᵀ dO − Wᵀ dU'
      mm<T>(true, false, C, V, C, T(1), x.P, C, dO, V, T(0), du, V);
      mm<T>(false, false, C, V, K, T(1), x.Kw, K, dh, V, T(1), du, V);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) dh_new[i * V + j] = x.last[i] * dh[i * V + j];
      mm<T>(true, false, K, V, C, T(1), x.Qr, K, dO, V, T(1), dh_new, V);
      mm<T>(true, false, K, V, C, T(-1), x.WU, KV, du, V, T(1), dh_new, V);
      // the cotangents of the state-free terms: d[W | U] = [−dU' hᵀ | dU'], dP = dO U'ᵀ,
      // dQ_r = dO hᵀ, dK_w = U' dhᵀ, d e^{b_C} = rowsum(h ⊙ dh)
      for (int64_t i = 0; i < C; ++i) std::memcpy(dwu + i * KV + K, du + i * V, sizeof(T) * V);
      mm<T>(false, true, C, K, V, T(-1), du, V, h, V, T(0), dwu, KV);
      mm<T>(false, true, C, C, V, T(1), dO, V, Up, V, T(0), dP, C);
      mm<T>(false, true, C, K, V, T(1), dO, V, h, V, T(0), dQr, K);
      mm<T>(false, true, C, K, V, T(1), Up, V, dh, V, T(0), dKw, K);
      if (c > 0) prefetch_rows(doh, do_s[2], t0 - C, C, V);
      // through the solve: dZ = Tᵀ d[W | U]; dA = −tril(dZ [W | U]ᵀ, −1)
      mm<T>(true, false, C, KV, C, T(1), x.Tm, C, dwu, KV, T(0), dz, KV);
      mm<T>(false, true, C, C, KV, T(-1), dz, KV, x.WU, KV, T(0), dA, C);
      for (int64_t i = 0; i < C; ++i) {
        if (beta != nullptr) {
          T acc_a = T(0);
          for (int64_t j = 0; j < i; ++j) acc_a += dA[i * C + j] * x.S[i * C + j];
          // dβ = Σ dZ ⊙ [K e^b | V] + Σ dA ⊙ S
          T acc_k = T(0);
          for (int64_t j = 0; j < K; ++j) acc_k += dz[i * KV + j] * x.Em[i * K + j] * x.fac[i * K + j];
          T acc_v = T(0);
          for (int64_t j = 0; j < V; ++j) acc_v += dz[i * KV + K + j] * x.Vm[i * V + j];
          dbc[i] = acc_k + acc_v + acc_a;
        }
        for (int64_t j = 0; j < i; ++j) dA[i * C + j] *= x.bvec[i];  // dS = diag(β) dA
        std::fill(dA + i * C + i, dA + (i + 1) * C, T(0));
        for (int64_t j = 0; j < C; ++j) dP[i * C + j] = j <= i ? dP[i * C + j] * scale : T(0);  // d(QKᵀ-decayed) = scale dP
      }
      // dE ⊙ e^b part (dR_K = β dZ_K; E = K for KDA), dQ, dK, dgk of the reads and writes
      for (int64_t i = 0; i < C; ++i) {
        const T bi = x.bvec[i], sc = scale;
        const T *__restrict fr = x.fac + i * K, *__restrict dzk = dz + i * KV, *__restrict dqr = dQr + i * K,
                            *__restrict dkw = dKw + i * K, *__restrict er = x.erow + i * K, *__restrict em = x.Em + i * K,
                            *__restrict qr = x.Qr + i * K;
        T *__restrict dq_ = dqc + i * K, *__restrict dk_ = dkc + i * K, *__restrict sp = span + i * K,
                      *__restrict dg = dgc + i * K;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) {
          const T dkr = bi * dzk[j];
          dq_[j] = dqr[j] * fr[j] * sc;
          sp[j] = dkr * em[j] * fr[j] + dqr[j] * qr[j];  // reverse cumsum below
          dg[j] = T(0);
        }
        if (dec != dkc) {
          T* __restrict de_ = dec + i * K;
#pragma omp simd
          for (int64_t j = 0; j < K; ++j) {
            de_[j] = bi * dzk[j] * fr[j];
            dk_[j] = dkw[j] * er[j];
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < K; ++j) dk_[j] = bi * dzk[j] * fr[j] + dkw[j] * er[j];
        }
        T* __restrict dvv = dz + i * KV + K;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) dvv[j] *= bi;  // dV
      }
      // e^{b_C}: every row; the reads (span [t, C)): reverse cumsum; the writes K_w (span (r, C)): exclusive
      {
        std::fill(dR, dR + K, T(0));  // running sums
        for (int64_t i = C - 1; i >= 0; --i)
          for (int64_t j = 0; j < K; ++j) {
            dR[j] += span[i * K + j];
            dgc[i * K + j] += dR[j];
          }
        std::fill(dR, dR + K, T(0));
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < K; ++j) {
            dgc[i * K + j] += dR[j];
            dR[j] += dKw[i * K + j] * x.Kw[i * K + j];
          }
        for (int64_t j = 0; j < K; ++j) {
          T dl = T(0);
          for (int64_t v2 = 0; v2 < V; ++v2) dl += h[j * V + v2] * dh[j * V + v2];
          dl *= x.last[j];
          for (int64_t i = 0; i < C; ++i) dgc[i * K + j] += dl;
        }
      }
      // S (x = E, dM = dS) and P (x = q, dM = scale dP), y = k, both at once per sub-block
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t r0 = j * s, m = r0 - 1;
        for (int64_t r = 0; r < s; ++r) {
          const T *__restrict el = x.eleft + (r0 + r) * K, *__restrict em = x.Em + (r0 + r) * K,
                              *__restrict qr = x.Q + (r0 + r) * K;
          T *__restrict le = x.Lf + r * K, *__restrict lq = x.Lf + (s + r) * K;
#pragma omp simd
          for (int64_t d = 0; d < K; ++d) {
            le[d] = em[d] * el[d];
            lq[d] = qr[d] * el[d];
          }
        }
        if (r0 > 0) {  // columns before the sub-block: M = Left Rightᵀ
          x.right_before(j, F);
          for (int64_t r = 0; r < s; ++r) {
            std::memcpy(dM + r * C, dA + (r0 + r) * C, sizeof(T) * r0);
            std::memcpy(dM + (s + r) * C, dP + (r0 + r) * C, sizeof(T) * r0);
          }
          mm<T>(false, false, 2 * s, K, r0, T(1), dM, C, x.Right, K, T(0), dL, K);
          mm<T>(true, false, r0, K, 2 * s, T(1), dM, C, x.Lf, K, T(0), dR, K);
          // left: dx_r += dL ⊙ e_left, dgk over (m, r]: a reverse cumsum inside the sub-block (row by
          // row, the running sums one per channel)
          std::fill(run, run + K, T(0));
          for (int64_t r = s - 1; r >= 0; --r) {
            const int64_t rr = r0 + r;
            const T *__restrict el = x.eleft + rr * K, *__restrict a = dL + r * K, *__restrict b = dL + (s + r) * K,
                                *__restrict la = x.Lf + r * K, *__restrict lb = x.Lf + (s + r) * K;
            T *__restrict de_ = dec + rr * K, *__restrict dq_ = dqc + rr * K, *__restrict dg = dgc + rr * K,
                          *__restrict rn = run;
#pragma omp simd
            for (int64_t d = 0; d < K; ++d) {
              de_[d] += a[d] * el[d];
              dq_[d] += b[d] * el[d];
              rn[d] += a[d] * la[d] + b[d] * lb[d];
              dg[d] += rn[d];
            }
          }
          // right: dy_i += dR ⊙ e^{b_m − b_i}, dgk over (i, m]: an exclusive cumsum over i < js
          std::fill(run, run + K, T(0));
          for (int64_t i = 0; i < r0; ++i) {
            const T *__restrict dr = dR + i * K, *__restrict f = F + i * K, *__restrict rt = x.Right + i * K;
            T *__restrict dg = dgc + i * K, *__restrict dk_ = dkc + i * K, *__restrict rn = run;
#pragma omp simd
            for (int64_t d = 0; d < K; ++d) {
              dg[d] += rn[d];
              dk_[d] += dr[d] * f[d];
              rn[d] += dr[d] * rt[d];
            }
          }
        }
        // inside the sub-block, pair by pair (i ≤ r): w = dM[r, i] e^{b_r − b_i}; span (i, r]. The
        // factor e^{b_r − b_i} is e^{b_r − b_m} e^{b_m − b_i} where every channel's span from the
        // reference point stays within the limit (as in the forward), else its own exponential.
        double span_max = 0.0;
        for (int64_t i = r0; i < r0 + s; ++i) {
          const double* bi = x.bd + i * K;
#pragma omp simd reduction(max : span_max)
          for (int64_t d = 0; d < K; ++d) span_max = std::max(span_max, std::abs(x.bm(m, d) - bi[d]));
        }
        const bool split = span_max <= x.limit();
        std::fill(Z, Z + s * s * K, T(0));
        for (int64_t r = 0; r < s; ++r) {
          const int64_t rr = r0 + r;
          for (int64_t i = 0; i <= r; ++i) {
            const int64_t ii = r0 + i;
            const T ds = i < r ? dA[rr * C + ii] : T(0), dp = dP[rr * C + ii];
            if (ds == T(0) && dp == T(0)) continue;
            if (split) {  // e^{b_r − b_m} · e^{b_m − b_i}, both finite (as the forward's sub-block products)
              const T *__restrict el = x.eleft + rr * K, *__restrict in_ = x.inside + ii * K;
              T* __restrict ac = x.across;
#pragma omp simd
              for (int64_t d = 0; d < K; ++d) ac[d] = el[d] * in_[d];
            } else {
              for (int64_t d = 0; d < K; ++d) x.exr[d] = x.bd[rr * K + d] - x.bd[ii * K + d];
              exp_of(x.exr, x.across, K);
            }
            const T *__restrict ac = x.across, *__restrict em = x.Em + rr * K, *__restrict qv = x.Q + rr * K,
                                *__restrict kv = x.Km + ii * K;
            T *__restrict z = Z + (r * s + i) * K, *__restrict de_ = dec + rr * K, *__restrict dq_ = dqc + rr * K;
            T* __restrict dkr = dkc + ii * K;  // (for KDA dec == dkc: row r of it is dkr's own when i = r)
            if (i < r) {
#pragma omp simd
              for (int64_t d = 0; d < K; ++d) {
                const T ws = ds * ac[d], wp = dp * ac[d], w = ws * em[d] + wp * qv[d];
                de_[d] += ws * kv[d];
                dq_[d] += wp * kv[d];
                dkr[d] += w;
                z[d] = w * kv[d];
              }
            } else {  // the diagonal (P's only: ds = 0, nothing for the erase side)
#pragma omp simd
              for (int64_t d = 0; d < K; ++d) {
                const T wp = dp * ac[d], w = wp * qv[d];
                dq_[d] += wp * kv[d];
                dkr[d] += w;
                z[d] = w * kv[d];
              }
            }
          }
        }
        // dgk_t += Σ_{r ≥ t} Σ_{i < t} Z[r, i] for t inside the sub-block
        for (int64_t t = 1; t < s; ++t)
          for (int64_t r = t; r < s; ++r)
            for (int64_t i = 0; i < t; ++i) {
              const T* z = Z + (r * s + i) * K;
              T* dst = dgc + (r0 + t) * K;
              for (int64_t d = 0; d < K; ++d) dst[d] += z[d];
            }
      }
      // write the chunk's gradients (rows past the end are padding: the buffers have NC·C rows)
      for (int64_t i = 0; i < C; ++i) {
        const int64_t o_row = (n * NC * C + t0 + i) * H + hh;
        store_scaled_stream(dqc + i * K, T(1), dq + o_row * K, K);
        store_scaled_stream(dkc + i * K, T(1), dk + o_row * K, K);
        store_scaled_stream(dgc + i * K, T(1), dgk + o_row * K, K);
        store_scaled_stream(dz + i * KV + K, T(1), dv + o_row * V, V);
        if (dbeta != nullptr) dbeta[o_row] = dbc[i];
        if (de != nullptr) store_scaled_stream(dec + i * K, T(1), de + o_row * K, K);
      }
      std::swap(dh, dh_new);
    }
    std::memcpy(dh0 + nh * K * V, dh, sizeof(T) * K * V);
    fastweights::cpu::store_fence();  // the streamed rows visible before the task ends
  }
};

// Shared by the forward and the backward: beta absent (β = 1) or [N, H, T]; erase absent (KDA) or
// k's shape with a unit last stride (GDN-2).
void check_beta_erase(const char* op, const torch::Tensor& k, const c10::optional<torch::Tensor>& beta,
                      const c10::optional<torch::Tensor>& erase) {
  TORCH_CHECK(!beta.has_value() || beta->dim() == 3, op, ": beta must be [N, H, T]");
  TORCH_CHECK(!erase.has_value() || (erase->sizes() == k.sizes() && erase->stride(3) == 1), op,
              ": erase must have k's shape [N, H, T, K] and a unit-stride last dim");
}

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V] (empty unless keep), decay_stats
// [N·H, 3] float64 (empty unless check_decay)). `beta` absent: β = 1; `erase` given: GDN-2's erase keys
// in the place of k on the erase side (file comment). `check_finite`: an op's name for the finite check
// of q, k, v ("" none); `check_decay`: gk's counts for its checks (Forward's comment). q, k, v of
// gk's dtype (fp32, fp64), or bf16 with fp32 beta, gk, h0 for inference (keep false, no erase): the
// fp32 forward on the rows widened as they are gathered, o bf16 (rounded once), h_T fp32.
std::vector<torch::Tensor> chunk_kda_fwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const c10::optional<torch::Tensor>& beta, const torch::Tensor& gk,
                                         const c10::optional<torch::Tensor>& h0, double scale, int64_t C, int64_t s,
                                         bool keep, const c10::optional<torch::Tensor>& erase,
                                         const std::string& check_finite, bool check_decay) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && gk.dim() == 4,
              "chunk_kda_fwd: q, k, v, gk must be [N, H, T, ·]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && gk.stride(3) == 1,
              "chunk_kda_fwd: last dims must be unit-stride");
  check_beta_erase("chunk_kda_fwd", k, beta, erase);
  TORCH_CHECK(C > 0 && s > 0 && C % s == 0, "chunk_kda_fwd: the chunk size must be a multiple of the sub-block size");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  const bool bf16_io = v.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(!bf16_io || (!keep && !erase.has_value() && q.scalar_type() == torch::kBFloat16 &&
                           k.scalar_type() == torch::kBFloat16 && gk.scalar_type() == torch::kFloat &&
                           (!beta.has_value() || beta->scalar_type() == torch::kFloat) &&
                           (!h0.has_value() || h0->scalar_type() == torch::kFloat)),
              "chunk_kda_fwd: bf16 q, k, v take float32 beta, gk, h0 and are for inference (keep false, no erase)");
  auto opts = gk.options();  // the arithmetic's dtype: the state's, what is kept
  torch::Tensor o = torch::empty({N, NC * C, H, V}, v.options()), h_out = torch::empty({N * H, K, V}, opts);
  torch::Tensor states = keep ? torch::empty({NC, N * H, K, V}, opts) : torch::empty({0}, opts);
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  torch::Tensor stats = torch::empty({check_decay ? N * H : 0, 3}, opts.dtype(torch::kDouble));
  FiniteCheck finite(check_finite);
  auto run = [&](auto* tag, auto* io_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using E = std::remove_pointer_t<decltype(io_tag)>;
    Forward<T, E> f;
    static_cast<Grid&>(f) = Grid{N, H, L, K, V, C, NC};
    f.s = s;
    f.bind(q, k, v, beta, gk, erase);
    f.h0 = data_if<T>(h0.has_value(), h0c);
    f.o = o.data_ptr<E>();
    f.h_out = h_out.data_ptr<T>();
    f.states = data_if<T>(keep, states);
    f.scale = T(scale);
    f.keep = keep;
    f.finite = &finite;
    f.decay_stats = data_if<double>(check_decay, stats);
    per_head(f);
  };
  if (bf16_io) run(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else fp32_or_fp64(v.scalar_type(), "chunk_kda_fwd", [&](auto* tag) { run(tag, tag); });
  finite.raise_if_any();
  return {o, h_out, states, stats};
}

// Returns (dq, dk, dv, dbeta, dgk [N, NC·C, H, ·] (dbeta [N, NC·C, H], empty without beta), dh0 [N·H, K, V],
// de [N, NC·C, H, K] (empty without erase)) from the forward's inputs, its chunk-entry states
// [NC, N·H, K, V], do [N, H, T, V] and the final state's gradient.
std::vector<torch::Tensor> chunk_kda_bwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const c10::optional<torch::Tensor>& beta, const torch::Tensor& gk,
                                         const torch::Tensor& states, const torch::Tensor& dout,
                                         const torch::Tensor& dh_final, double scale, int64_t C, int64_t s,
                                         const c10::optional<torch::Tensor>& erase) {
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && gk.stride(3) == 1 && dout.stride(3) == 1,
              "chunk_kda_bwd: last dims must be unit-stride");
  check_beta_erase("chunk_kda_bwd", k, beta, erase);
  TORCH_CHECK(states.is_contiguous() && states.dim() == 4, "chunk_kda_bwd: states must be a contiguous [NC, N·H, K, V]");
  TORCH_CHECK(C > 0 && s > 0 && C % s == 0, "chunk_kda_bwd: the chunk size must be a multiple of the sub-block size");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = states.size(0);
  TORCH_CHECK(NC == (L + C - 1) / C, "chunk_kda_bwd: states do not match T / C");
  auto opts = states.options();
  torch::Tensor dq = torch::empty({N, NC * C, H, K}, opts), dk = torch::empty({N, NC * C, H, K}, opts);
  torch::Tensor dv = torch::empty({N, NC * C, H, V}, opts);
  torch::Tensor dbeta = beta.has_value() ? torch::empty({N, NC * C, H}, opts) : torch::empty({0}, opts);
  torch::Tensor dgk = torch::empty({N, NC * C, H, K}, opts), dh0 = torch::empty({N * H, K, V}, opts);
  torch::Tensor de = erase.has_value() ? torch::empty({N, NC * C, H, K}, opts) : torch::empty({0}, opts);
  torch::Tensor dhf = dh_final.contiguous();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Backward<T> b;
    static_cast<Grid&>(b) = Grid{N, H, L, K, V, C, NC};
    b.s = s;
    b.bind(q, k, v, beta, gk, erase);
    b.dout = rows_of<T>(dout, b.do_s);
    b.states = states.data_ptr<T>();
    b.dh_final = dhf.data_ptr<T>();
    b.dq = dq.data_ptr<T>();
    b.dk = dk.data_ptr<T>();
    b.dv = dv.data_ptr<T>();
    b.dbeta = data_if<T>(beta.has_value(), dbeta);
    b.dgk = dgk.data_ptr<T>();
    b.de = data_if<T>(erase.has_value(), de);
    b.dh0 = dh0.data_ptr<T>();
    b.scale = T(scale);
    per_head(b);
  };
  fp32_or_fp64(states.scalar_type(), "chunk_kda_bwd", run);
  return {dq, dk, dv, dbeta, dgk, dh0, de};
}

// One decode token of KDA per head: h' = diag(α) h, u = β (v − h'ᵀ k), h' += k uᵀ, o = scale · h'ᵀ q,
// α = e^{gk}. q, k, gk [NH, K], v [NH, V], beta [NH], h [NH, K, V] contiguous, all of one dtype.
// Two passes over the state: the first decays it into h_out while it accumulates h'ᵀk and h'ᵀq,
// the second adds k uᵀ; o = scale · (h'ᵀq + (kᵀq) u) needs no third pass.
template <typename T>
void kda_step_heads(const T* q, const T* k, const T* v, const T* beta, const T* gk, const T* h, T* h_out, T* o,
                    int64_t NH, int64_t K, int64_t V, T scale) {
  at::parallel_for(0, NH, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(2 * V + K);
    T *hk = buf.data(), *hq = hk + V, *alpha = hq + V;
    for (int64_t nh = begin; nh < end; ++nh) {
      const T *qh = q + nh * K, *kh = k + nh * K, *vh = v + nh * V, *gh = gk + nh * K, *src = h + nh * K * V;
      T* dst = h_out + nh * K * V;
      for (int64_t i = 0; i < K; ++i) alpha[i] = std::exp(gh[i]);
      std::fill(hk, hk + V, T(0));
      std::fill(hq, hq + V, T(0));
      T kq = T(0);
      for (int64_t i = 0; i < K; ++i) {
        const T a = alpha[i], ki = kh[i], qi = qh[i];
        const T* sr = src + i * V;
        T* dr = dst + i * V;
        kq += ki * qi;
        for (int64_t j = 0; j < V; ++j) {
          const T x = a * sr[j];
          dr[j] = x;
          hk[j] += ki * x;
          hq[j] += qi * x;
        }
      }
      const T b = beta[nh];
      T* oh = o + nh * V;
      for (int64_t j = 0; j < V; ++j) {
        hk[j] = b * (vh[j] - hk[j]);  // u
        oh[j] = scale * (hq[j] + kq * hk[j]);
      }
      for (int64_t i = 0; i < K; ++i) {
        const T ki = kh[i];
        T* dr = dst + i * V;
        for (int64_t j = 0; j < V; ++j) dr[j] += ki * hk[j];
      }
    }
  });
}

// q, k, gk [NH, K], v [NH, V], beta [NH] (cast to the state's dtype), state [NH, K, V] contiguous
// float32/float64. Returns (o [NH, V] in the state's dtype, the new state [NH, K, V]).
std::vector<torch::Tensor> kda_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& beta, const torch::Tensor& gk, const torch::Tensor& state,
                                    double scale) {
  TORCH_CHECK(state.dim() == 3 && state.is_contiguous(), "kda_step: the state must be a contiguous [NH, K, V] tensor");
  const auto dt = state.scalar_type();
  TORCH_CHECK(dt == torch::kFloat || dt == torch::kDouble, "kda_step: a float32 or float64 state only");
  const int64_t NH = state.size(0), K = state.size(1), V = state.size(2);
  auto rows = [&](const torch::Tensor& t, int64_t w) {
    torch::Tensor r = t.to(dt).reshape(w < 0 ? at::IntArrayRef{NH} : at::IntArrayRef{NH, w});
    return r.is_contiguous() ? r : r.contiguous();
  };
  torch::Tensor qr = rows(q, K), kr = rows(k, K), vr = rows(v, V), br = rows(beta, -1), gr = rows(gk, K);
  torch::Tensor h_out = torch::empty_like(state), o = torch::empty({NH, V}, state.options());
  if (dt == torch::kFloat) {
    kda_step_heads<float>(qr.data_ptr<float>(), kr.data_ptr<float>(), vr.data_ptr<float>(), br.data_ptr<float>(),
                          gr.data_ptr<float>(), state.data_ptr<float>(), h_out.data_ptr<float>(), o.data_ptr<float>(),
                          NH, K, V, float(scale));
  } else {
    kda_step_heads<double>(qr.data_ptr<double>(), kr.data_ptr<double>(), vr.data_ptr<double>(), br.data_ptr<double>(),
                           gr.data_ptr<double>(), state.data_ptr<double>(), h_out.data_ptr<double>(),
                           o.data_ptr<double>(), NH, K, V, scale);
  }
  return {o, h_out};
}

}  // namespace

void register_chunk_kda(pybind11::module& m) {  // called by module.cpp's PYBIND11_MODULE
  m.def("chunk_kda_fwd", &chunk_kda_fwd, "KDA's (and GDN-2's, given `erase`) chunk forward, one task per (sequence, head)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("beta"), pybind11::arg("gk"),
        pybind11::arg("h0"), pybind11::arg("scale"), pybind11::arg("chunk_size"), pybind11::arg("sub_block"),
        pybind11::arg("keep"), pybind11::arg("erase") = pybind11::none(), pybind11::arg("check_finite") = "",
        pybind11::arg("check_decay") = false);
  m.def("chunk_kda_bwd", &chunk_kda_bwd, "its backward, one task per (sequence, head), last chunk first");
  m.def("kda_step", &kda_step, "one decode token of KDA, one task per head");
}
