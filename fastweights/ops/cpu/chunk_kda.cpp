// Kimi Delta Attention's chunk forward and decode step on the CPU, one (sequence, head) per task.
//
// The algebra is fastweights/ops/kda/chunk.py's and kda/parallel.py's (Kimi Team 2025, "Kimi
// Linear", arXiv:2510.26692; the UT transform of Yang et al. 2024, arXiv:2406.06484). Per chunk
// of C tokens, with b = cumsum(gk) inside the chunk (one column per key channel):
//   S[r, i] = Σ_d k_r[d] k_i[d] e^{b_r[d] − b_i[d]} (i < r),  P = scale · the same with q_r (i ≤ r)
//   T = (I + diag(β) S)⁻¹,  [W | U] = T diag(β) [K ⊙ e^b | V]
//   U' = U − W h,  O = scale · (Q ⊙ e^b) h + P U',  h ← diag(e^{b_C}) h + (K ⊙ e^{b_C − b})ᵀ U'
//
// S and P are computed in the relative form of kda/parallel.py, with the same reference points:
// rows in sub-blocks of s tokens, sub-block j measured from m = js − 1 (b_{−1} = 0), so the
// factors e^{b_r − b_m} of its rows and e^{b_m − b_i} of earlier columns are both ≤ 1 and
// nothing overflows however strong the decay. The earlier columns' factor is taken as
// e^{b_m − b_e(j')} · e^{b_e(j') − b_i}, e(j') the last token of the column's sub-block (two ≤ 1
// factors; C·K + nb²·K/2 exponentials instead of C²·K/(2s)). Pairs inside a sub-block are
// e^{b_r − b_m} · e^{b_m − b_i} when every channel decays by less than e^{±60} across the
// sub-block (the second factor ≥ 1 but finite: the whole row block is then one product),
// else summed exactly pair by pair. Each sub-block's rows of S and P are one BLAS call
// ([K ⊙ e_left ; scale · Q ⊙ e_left] against the columns' factors). The cumulative decays
// are summed in float64, and every exponent is rounded to the working precision only as a
// difference, as in the PyTorch form.
//
// The forward keeps the chunk-entry states; chunk_kda's backward (PyTorch) recomputes the rest.
#include "chunk_common.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace fastweights::cpu::chunk;

#if defined(__AVX512F__)
// e^x for 16 floats (x ≤ 88): Cody–Waite reduction by ln 2, Cephes' degree-6 polynomial for
// e^r on |r| ≤ ln2/2, and the exact scaling by 2^n; e^x for x < −87.3 (below the smallest
// normal float) is returned as 0. About 1 ulp.
inline __m512 exp16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
#endif

// out[i] = e^{x[i]} for float64 exponents x, rounded to T first (the difference is what rounds).
template <typename T>
inline void exp_of(const double* x, T* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(_mm512_loadu_pd(x + i))),
                                          _mm512_cvtpd_ps(_mm512_loadu_pd(x + i + 8)), 1);
      _mm512_storeu_ps(out + i, exp16(v));
    }
  }
#endif
  for (; i < n; ++i) out[i] = std::exp(T(x[i]));
}

// Tm = (I + diag(β) S)⁻¹ for strictly lower S, row by row: T_r = e_r − β_r Σ_{i<r} S[r, i] T_i.
template <typename T>
void unit_lower_inverse(int64_t C, const T* S, const T* beta, T* Tm) {
  std::fill(Tm, Tm + C * C, T(0));
  for (int64_t r = 0; r < C; ++r) {
    T* tr = Tm + r * C;
    const T* s = S + r * C;
    for (int64_t i = 0; i < r; ++i) {
      const T a = -beta[r] * s[i];
      const T* ti = Tm + i * C;
      for (int64_t j = 0; j <= i; ++j) tr[j] += a * ti[j];
    }
    tr[r] = T(1);
  }
}

template <typename T>
struct Forward {
  const T *q, *k, *v, *beta, *gk, *h0;  // head-first [N, H, T, ·] (beta [N, H, T]), unit last stride
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, gk_s[3] = {};
  T *o, *h_out, *states;                // [N, NC·C, H, V], [N·H, K, V], [NC, N·H, K, V] (keep only)
  int64_t N, H, L, K, V, C, NC, s;      // s: the sub-block size (C a multiple of it)
  T scale;
  bool keep;

  static constexpr int64_t kDoubles = int64_t(sizeof(double) / sizeof(T));  // T elements per double

  int64_t scratch_size() const {
    const int64_t CK = round16(C * K), KV = K + V;
    return 12 * CK + 2 * kDoubles * CK + round16(C * V) * 2 + round16(2 * s * C) + 3 * round16(C * C) +
           2 * round16(C * KV) + round16(K * V) + round16(C) + round16(K) + kDoubles * round16(K) + round16(2 * s * K);
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H, KV = K + V, nb = C / s;
    Carve<T> sc{scratch};
    T *Q = sc.take(C * K), *Km = sc.take(C * K), *Vm = sc.take(C * V), *O = sc.take(C * V);
    double* bd = reinterpret_cast<double*>(sc.take(kDoubles * C * K));   // b = cumsum(gk)
    double* ex = reinterpret_cast<double*>(sc.take(kDoubles * C * K));   // exponents, then exponentials
    double* exr = reinterpret_cast<double*>(sc.take(kDoubles * K));      // one row of exponents
    T *eleft = sc.take(C * K), *kr = sc.take(C * K), *Qr = sc.take(C * K), *Kw = sc.take(C * K);
    T *inside = sc.take(C * K), *Right = sc.take(C * K), *across = sc.take(C * K), *fac = sc.take(C * K);
    T *gin = sc.take(C * K), *erow = sc.take(C * K);
    T *Lf = sc.take(2 * s * K), *M = sc.take(2 * s * C);
    T *S = sc.take(C * C), *P = sc.take(C * C), *Tm = sc.take(C * C);
    T *R = sc.take(C * KV), *WU = sc.take(C * KV), *h = sc.take(K * V), *bvec = sc.take(C);
    T* last = sc.take(K);
    T* Up = WU + K;
    const T* qh = q + n * q_s[0] + hh * q_s[1];
    const T* kh = k + n * k_s[0] + hh * k_s[1];
    const T* vh = v + n * v_s[0] + hh * v_s[1];
    const T* bh = beta + n * beta_s[0] + hh * beta_s[1];
    const T* gh = gk + n * gk_s[0] + hh * gk_s[1];
    const double limit = std::is_same_v<T, float> ? 60.0 : 600.0;  // e^{±limit} stays finite in T
    if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(T) * K * V);
    else std::fill(h, h + K * V, T(0));
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      gather_rows(qh, q_s[2], t0, L, C, K, Q, K);
      gather_rows(kh, k_s[2], t0, L, C, K, Km, K);
      gather_rows(vh, v_s[2], t0, L, C, V, Vm, V);
      gather_rows(gh, gk_s[2], t0, L, C, K, gin, K);
      for (int64_t i = 0; i < C; ++i) bvec[i] = t0 + i < L ? bh[(t0 + i) * beta_s[2]] : T(0);
      // b = cumsum(gk) in float64
      for (int64_t j = 0; j < K; ++j) bd[j] = double(gin[j]);
      for (int64_t i = 1; i < C; ++i)
        for (int64_t j = 0; j < K; ++j) bd[i * K + j] = bd[(i - 1) * K + j] + double(gin[i * K + j]);
      const double* bC = bd + (C - 1) * K;
      // e^b (the state's reads), e^{b_C − b} (its writes), e^{b_C}
      exp_of(bd, fac, C * K);
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < K; ++j) ex[i * K + j] = bC[j] - bd[i * K + j];
      exp_of(ex, erow, C * K);
      for (int64_t i = 0; i < C * K; ++i) {
        Qr[i] = Q[i] * fac[i] * scale;
        Kw[i] = Km[i] * erow[i];
      }
      std::memcpy(last, fac + (C - 1) * K, sizeof(T) * K);
      // R = diag(β) [K ⊙ e^b | V]
      for (int64_t i = 0; i < C; ++i) {
        for (int64_t j = 0; j < K; ++j) R[i * KV + j] = bvec[i] * Km[i * K + j] * fac[i * K + j];
        for (int64_t j = 0; j < V; ++j) R[i * KV + K + j] = bvec[i] * Vm[i * V + j];
      }
      // the sub-block factors: e_left[r] = e^{b_r − b_m(r)}; kr[i] = k_i e^{b_e(i) − b_i} (e(i): the
      // last token of i's sub-block); inside[i] = e^{b_m(i) − b_i} ≥ 1 (used only where finite)
      for (int64_t i = 0; i < C; ++i) {
        const int64_t m = (i / s) * s - 1, e = (i / s) * s + s - 1;
        for (int64_t j = 0; j < K; ++j) {
          const double bm = m < 0 ? 0.0 : bd[m * K + j];
          ex[i * K + j] = bd[i * K + j] - bm;
        }
        exp_of(ex + i * K, eleft + i * K, K);
        for (int64_t j = 0; j < K; ++j) exr[j] = bd[e * K + j] - bd[i * K + j];
        exp_of(exr, kr + i * K, K);
        for (int64_t j = 0; j < K; ++j) {
          kr[i * K + j] *= Km[i * K + j];
          exr[j] = -ex[i * K + j];
        }
        exp_of(exr, inside + i * K, K);
      }
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t r0 = j * s, m = r0 - 1;
        // rows: [K ⊙ e_left ; scale · Q ⊙ e_left] for the sub-block's s rows
        for (int64_t r = 0; r < s; ++r)
          for (int64_t d = 0; d < K; ++d) {
            const T e = eleft[(r0 + r) * K + d];
            Lf[r * K + d] = Km[(r0 + r) * K + d] * e;
            Lf[(s + r) * K + d] = Q[(r0 + r) * K + d] * e * scale;
          }
        // columns before the sub-block: k_i e^{b_m − b_i} = kr[i] · e^{b_m − b_e(j')}
        for (int64_t jp = 0; jp < j; ++jp) {
          const int64_t e = jp * s + s - 1;
          for (int64_t d = 0; d < K; ++d) exr[d] = bd[m * K + d] - bd[e * K + d];
          exp_of(exr, across, K);
          for (int64_t i = jp * s; i < e + 1; ++i)
            for (int64_t d = 0; d < K; ++d) Right[i * K + d] = kr[i * K + d] * across[d];
        }
        // inside the sub-block: the split factors when every channel stays within e^{±limit}
        bool split = true;
        for (int64_t i = r0; i < r0 + s && split; ++i)
          for (int64_t d = 0; d < K; ++d) {
            const double bm = m < 0 ? 0.0 : bd[m * K + d];
            if (std::abs(bm - bd[i * K + d]) > limit) { split = false; break; }
          }
        const int64_t cols = split ? r0 + s : r0;
        if (split)
          for (int64_t i = r0; i < r0 + s; ++i)
            for (int64_t d = 0; d < K; ++d) Right[i * K + d] = Km[i * K + d] * inside[i * K + d];
        if (cols > 0) mm<T>(false, true, 2 * s, cols, K, T(1), Lf, K, Right, K, T(0), M, C);
        for (int64_t r = 0; r < s; ++r) {
          const int64_t rr = r0 + r;
          for (int64_t i = 0; i < r0; ++i) {
            S[rr * C + i] = M[r * C + i];
            P[rr * C + i] = M[(s + r) * C + i];
          }
          for (int64_t i = r0; i <= rr; ++i) {
            T sv, pv;
            if (split) {
              sv = M[r * C + i];
              pv = M[(s + r) * C + i];
            } else {  // exactly: Σ_d x_r y_i e^{b_r − b_i}
              for (int64_t d = 0; d < K; ++d) exr[d] = bd[rr * K + d] - bd[i * K + d];
              exp_of(exr, erow, K);
              sv = pv = T(0);
              for (int64_t d = 0; d < K; ++d) {
                const T ky = Km[i * K + d] * erow[d];
                sv += Km[rr * K + d] * ky;
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
      // [W | U] = T R;  U' = U − W h;  O = Q_r h + P U';  h ← diag(e^{b_C}) h + K_wᵀ U'
      unit_lower_inverse<T>(C, S, bvec, Tm);
      mm<T>(false, false, C, KV, C, T(1), Tm, C, R, KV, T(0), WU, KV);
      if (keep) std::memcpy(states + row * K * V, h, sizeof(T) * K * V);
      mm<T>(false, false, C, V, K, T(-1), WU, KV, h, V, T(1), Up, KV);
      mm<T>(false, false, C, V, K, T(1), Qr, K, h, V, T(0), O, V);
      mm<T>(false, false, C, V, C, T(1), P, C, Up, KV, T(1), O, V);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) h[i * V + j] *= last[i];
      mm<T>(true, false, K, V, C, T(1), Kw, K, Up, KV, T(1), h, V);
      scatter_rows(O, V, C, V, o, n, NC * C, H, hh, t0);
    }
    std::memcpy(h_out + nh * K * V, h, sizeof(T) * K * V);
  }
};

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V] (empty unless keep)).
std::vector<torch::Tensor> chunk_kda_fwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const torch::Tensor& beta, const torch::Tensor& gk,
                                         const c10::optional<torch::Tensor>& h0, double scale, int64_t C, int64_t s,
                                         bool keep) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && gk.dim() == 4 && beta.dim() == 3,
              "chunk_kda_fwd: q, k, v, gk must be [N, H, T, ·] and beta [N, H, T]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && gk.stride(3) == 1,
              "chunk_kda_fwd: last dims must be unit-stride");
  TORCH_CHECK(C > 0 && s > 0 && C % s == 0, "chunk_kda_fwd: the chunk size must be a multiple of the sub-block size");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  auto opts = v.options();
  torch::Tensor o = torch::empty({N, NC * C, H, V}, opts), h_out = torch::empty({N * H, K, V}, opts);
  torch::Tensor states = keep ? torch::empty({NC, N * H, K, V}, opts) : torch::empty({0}, opts);
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Forward<T> f;
    f.q = q.data_ptr<T>();
    f.k = k.data_ptr<T>();
    f.v = v.data_ptr<T>();
    f.beta = beta.data_ptr<T>();
    f.gk = gk.data_ptr<T>();
    f.h0 = h0.has_value() ? h0c.data_ptr<T>() : nullptr;
    strides3(q, f.q_s);
    strides3(k, f.k_s);
    strides3(v, f.v_s);
    strides3(beta, f.beta_s);
    strides3(gk, f.gk_s);
    f.o = o.data_ptr<T>();
    f.h_out = h_out.data_ptr<T>();
    f.states = keep ? states.data_ptr<T>() : nullptr;
    f.N = N; f.H = H; f.L = L; f.K = K; f.V = V; f.C = C; f.NC = NC; f.s = s;
    f.scale = T(scale);
    f.keep = keep;
    per_head(f);
  };
  if (v.scalar_type() == torch::kFloat) run(static_cast<float*>(nullptr));
  else {
    TORCH_CHECK(v.scalar_type() == torch::kDouble, "chunk_kda_fwd: float32 or float64 only");
    run(static_cast<double*>(nullptr));
  }
  return {o, h_out, states};
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

void register_chunk_kda(pybind11::module& m) {  // called by chunk_delta.cpp's PYBIND11_MODULE
  m.def("chunk_kda_fwd", &chunk_kda_fwd, "KDA's chunk forward, one task per (sequence, head)");
  m.def("kda_step", &kda_step, "one decode token of KDA, one task per head");
}
