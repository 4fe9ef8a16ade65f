// The (gated) delta rule's chunk forward and backward on the CPU (fp32, fp64), one (sequence,
// head) per task; the shared pieces are chunk_common.h, the bf16-products forward is
// chunk_delta_bf16.cpp.
//
// The algebra is that of fastweights/ops/delta_rule/chunk.py (the WY/UT form, Yang et al.
// 2024, arXiv:2406.06484); this file only changes where the work happens. The PyTorch path
// batches every chunk's products into small-tile `bmm` calls and moves the chunks through
// memory several times (gather, solve, scan, scatter). Here each task runs one head's
// chunks start to finish with its state and every per-chunk matrix in the core's own
// cache, and each product is one BLAS call on a whole tile (gemm.h; MKL's sgemm/dgemm reach the
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
#include "chunk_common.h"

namespace {

using namespace fastweights::cpu::chunk;
using fastweights::cpu::mm;
using fastweights::cpu::round16;

// E: the type of q, k, v and o — T, or bf16 (inference only: plain bf16 inputs widened in the
// gather and the output rounded on its way out, so no pass over the inputs converts them first).
template <typename T, typename E = T>
struct Forward : Grid {
  // inputs, head-first [N, H, T, ·] with unit stride in the last dim; strides (n, h, t) in elements
  const E *q, *k, *v;
  const T *beta, *g, *h0;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, g_s[3] = {};
  // outputs
  E* o;       // [N, NC·C, H, V] contiguous
  T* h_out;   // [N·H, K, V]
  T* states;  // [NC, N·H, K, V]: the state entering each chunk (keep only)
  T *q_flat, *kv_flat, *wu, *inverses;  // kept: [NC·N·H, C, K], [.., C, K+V], [.., C, K+V], [nb, NC·N·H, bs, bs]
  int64_t nb;
  T scale;
  bool keep;
  FiniteCheck* finite;  // the fused finite check of q, k, v (chunk_common.h)

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
    const auto in = HeadRows<E, T>::at(n, hh, q, q_s, k, k_s, v, v_s, beta, beta_s, g, g_s, L, K, V, C);
    const bool gated = g != nullptr;
    int64_t bad[3] = {0, 0, 0};
    int64_t* count = finite->on() ? bad : nullptr;
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      in.gather(t0, Q, KVm, bvec, bcum, /*prefetch_ahead=*/true, count);
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
      for (int64_t i = 0; i < C; ++i) store_row(O + i * V, o + ((n * NC * C + t0 + i) * H + hh) * V, V);
      if (keep) {
        std::memcpy(q_flat + row * C * K, Q, sizeof(T) * C * K);
        std::memcpy(kv_flat + row * C * KV, KVm, sizeof(T) * C * KV);
        std::memcpy(wu + row * C * KV, WU, sizeof(T) * C * KV);
      }
    }
    std::memcpy(h_out + nh * K * V, h, sizeof(T) * K * V);
    if (count != nullptr) finite->add(count);
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
struct Backward : Grid {
  const T *q_flat, *kv_flat, *wu, *states, *beta, *g, *dout, *dh_final;
  int64_t beta_s[3] = {}, g_s[3] = {}, do_s[3] = {};
  T *dq, *dk, *dv, *dbeta, *dg, *dh0;  // [N, NC·C, H, ·] (dbeta, dg [N, NC·C, H]); dh0 [N·H, K, V]
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
        read_write_gate_grad(C, K, Qb, dQb, Kbar, dKbar, P, dP, last, d_last, db);
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

template <typename T, typename E = T>
void run_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& beta,
                 const c10::optional<torch::Tensor>& g, const c10::optional<torch::Tensor>& h0, double scale,
                 int64_t C, int64_t nb, bool keep, torch::Tensor& o, torch::Tensor& h_out, torch::Tensor& states,
                 torch::Tensor& q_flat, torch::Tensor& kv_flat, torch::Tensor& wu, torch::Tensor& inverses,
                 FiniteCheck& finite) {
  Forward<T, E> f;
  static_cast<Grid&>(f) = Grid{k.size(0), k.size(1), k.size(2), k.size(3), v.size(3), C, (k.size(2) + C - 1) / C};
  f.nb = nb;
  f.q = rows_of<E>(q, f.q_s);
  f.k = rows_of<E>(k, f.k_s);
  f.v = rows_of<E>(v, f.v_s);
  f.beta = rows_of<T>(beta, f.beta_s);
  f.g = rows_of<T>(g, f.g_s);
  f.h0 = h0.has_value() ? h0->data_ptr<T>() : nullptr;
  f.o = o.data_ptr<E>();
  f.h_out = h_out.data_ptr<T>();
  f.states = data_if<T>(keep, states);
  f.q_flat = data_if<T>(keep, q_flat);
  f.kv_flat = data_if<T>(keep, kv_flat);
  f.wu = data_if<T>(keep, wu);
  f.inverses = data_if<T>(keep, inverses);
  f.scale = T(scale);
  f.keep = keep;
  f.finite = &finite;
  per_head(f);
}

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V], q_flat, kv_flat, wu, inverses);
// all but o and h_T are what the backward keeps, and empty unless keep. q, k, v (and o) are of
// beta's dtype (fp32, fp64), or bf16 with fp32 beta for inference (keep false): fp32 arithmetic
// throughout, the inputs widened as they are gathered.
std::vector<torch::Tensor> chunk_delta_fwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                           const torch::Tensor& beta, const c10::optional<torch::Tensor>& g,
                                           const c10::optional<torch::Tensor>& h0, double scale, int64_t C,
                                           int64_t nb, bool keep, const std::string& check_finite) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && beta.dim() == 3, "chunk_delta_fwd: bad ranks");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "chunk_delta_fwd: last dims must be unit-stride");
  TORCH_CHECK(C > 0 && nb > 0 && C % nb == 0, "chunk_delta_fwd: bad chunk size / row blocks");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  const int64_t rows = NC * N * H, bs = C / nb;
  auto opts = beta.options();  // the arithmetic's dtype: the state, what is kept
  const bool bf16_io = v.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(!bf16_io || (!keep && beta.scalar_type() == torch::kFloat && q.scalar_type() == torch::kBFloat16 &&
                           k.scalar_type() == torch::kBFloat16),
              "chunk_delta_fwd: bf16 q, k, v take float32 beta and are for inference (keep false)");
  TORCH_CHECK(bf16_io || (q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type() &&
                          beta.scalar_type() == v.scalar_type()), "chunk_delta_fwd: q, k, v, beta of one dtype");
  torch::Tensor o = torch::empty({N, NC * C, H, V}, v.options());
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
  FiniteCheck finite(check_finite);
  if (bf16_io) {
    run_forward<float, at::BFloat16>(q, k, v, beta, g, h0c, scale, C, nb, keep, o, h_out, states, q_flat, kv_flat, wu,
                                     inverses, finite);
  } else if (v.scalar_type() == torch::kFloat) {
    run_forward<float>(q, k, v, beta, g, h0c, scale, C, nb, keep, o, h_out, states, q_flat, kv_flat, wu, inverses, finite);
  } else {
    TORCH_CHECK(v.scalar_type() == torch::kDouble, "chunk_delta_fwd: float32, float64 or bf16 inputs only");
    run_forward<double>(q, k, v, beta, g, h0c, scale, C, nb, keep, o, h_out, states, q_flat, kv_flat, wu, inverses, finite);
  }
  finite.raise_if_any();
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
    static_cast<Grid&>(b) = Grid{N, H, L, K, V, C, NC};
    b.q_flat = q_flat.data_ptr<T>();
    b.kv_flat = kv_flat.data_ptr<T>();
    b.wu = wu.data_ptr<T>();
    b.states = states.data_ptr<T>();
    b.beta = rows_of<T>(beta, b.beta_s);
    b.g = rows_of<T>(g, b.g_s);
    b.dout = rows_of<T>(dout, b.do_s);
    b.dh_final = dhf.data_ptr<T>();
    b.dq = dq.data_ptr<T>();
    b.dk = dk.data_ptr<T>();
    b.dv = dv.data_ptr<T>();
    b.dbeta = dbeta.data_ptr<T>();
    b.dg = g.has_value() ? dg.data_ptr<T>() : nullptr;
    b.dh0 = dh0.data_ptr<T>();
    b.scale = T(scale);
    per_head(b);
  };
  fp32_or_fp64(states.scalar_type(), "chunk_delta_bwd", fill);
  return {dq, dk, dv, dbeta, dg, dh0};
}

}  // namespace

void register_chunk_delta(pybind11::module& m) {
  namespace py = pybind11;
  m.def("chunk_delta_fwd", &chunk_delta_fwd, "the (gated) delta rule's chunk forward, one task per (sequence, head)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("beta"), py::arg("g"), py::arg("h0"), py::arg("scale"),
        py::arg("chunk_size"), py::arg("nb"), py::arg("keep"), py::arg("check_finite") = "");
  m.def("chunk_delta_bwd", &chunk_delta_bwd, "its backward, one task per (sequence, head), last chunk first");
}
