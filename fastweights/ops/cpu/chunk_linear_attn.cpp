// Linear attention's chunk forward and backward on the CPU, one (sequence, head) per task.
//
// The algebra is fastweights/ops/linear_attn/chunk.py's (Yang et al. 2024, arXiv:2312.06635,
// the chunkwise form; the delta rule's with W = 0 and U = V). Per chunk of C tokens with the
// scalar log decay g (b = cumsum(g) inside the chunk, Γ[r, i] = e^{b_r − b_i}; all 1 without g):
//   P  = scale · lower(Q Kᵀ ⊙ Γ)
//   O  = scale · (Q ⊙ e^b) h + P V
//   h ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ V
// The normalizer (normalize=True) arrives as one more value column of ones (the front end's
// (S, z) pair), so the kernel sees V + 1 columns and needs no case of its own.
//
// Backward, last chunk first, with dh the gradient of the state leaving the chunk:
//   dV = Pᵀ dO + K̄ dh                 dh_c = e^{b_C} dh + scale · Q_bᵀ dO
//   dP = dO Vᵀ, dQ_b = scale · dO hᵀ, dK̄ = V dhᵀ
//   dQ = dQ_b ⊙ e^b + (dP ⊙ Γ · scale) K,   dK = dK̄ ⊙ e^{b_C − b} + (dP ⊙ Γ · scale)ᵀ Q
//   db_r = Σ dQ_b ⊙ Q_b − Σ dK̄ ⊙ K̄ + Σ_i (dP ⊙ P)[r, i] − Σ_i (dP ⊙ P)[i, r],
//   db_C += Σ dK̄ ⊙ K̄ + e^{b_C} ⟨h, dh⟩,   dg = the reverse cumsum of db inside the chunk.
#include "chunk_rows.h"

namespace {

using namespace fastweights::cpu::chunk;

// b = cumsum(g) in place, e^b, e^{b_C − b}, and P's mask and decay in place (lower triangle
// with the diagonal kept, Γ written into G when given). Γ is e^{b_i} · e^{−b_j} when every |b|
// in the chunk is at most 60 (no factor over- or underflows), else the difference's exponential.
template <typename T>
void decay_terms(int64_t C, T* b, T* rd, T* te, T* P, T* G) {
  for (int64_t i = 1; i < C; ++i) b[i] += b[i - 1];
  bool split = C <= 1024;
  for (int64_t i = 0; i < C; ++i) {
    rd[i] = std::exp(b[i]);
    te[i] = std::exp(b[C - 1] - b[i]);
    split = split && std::abs(b[i]) <= T(60);
  }
  T down[1024];
  if (split)
    for (int64_t j = 0; j < C; ++j) down[j] = std::exp(-b[j]);
  for (int64_t i = 0; i < C; ++i) {
    T* p = P + i * C;
    for (int64_t j = 0; j <= i; ++j) {
      const T gam = split ? rd[i] * down[j] : std::exp(b[i] - b[j]);
      if (G != nullptr) G[i * C + j] = gam;
      p[j] *= gam;
    }
  }
}

template <typename T>
void causal_mask(int64_t C, T* P) {
  for (int64_t i = 0; i < C; ++i) std::fill(P + i * C + i + 1, P + (i + 1) * C, T(0));
}

template <typename T>
struct Forward {
  const T *q, *k, *v, *g, *h0;  // head-first [N, H, T, ·] (g [N, H, T]), unit last stride
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, g_s[3] = {};
  T *o, *h_out, *states;        // [N, NC·C, H, V], [N·H, K, V], [NC, N·H, K, V]
  T *qc, *kc, *vc, *gc;         // kept: the flattened chunks [NC·N·H, C, ·] (gc [NC·N·H, C])
  int64_t N, H, L, K, V, C, NC;
  T scale;
  bool keep;

  int64_t scratch_size() const {
    return 3 * round16(C * K) + 2 * round16(C * V) + round16(C * C) + round16(K * V) + 3 * round16(C);
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H;
    Carve<T> s{scratch};
    T *Q = s.take(C * K), *Km = s.take(C * K), *Kbar = s.take(C * K), *Vm = s.take(C * V), *O = s.take(C * V);
    T *P = s.take(C * C), *h = s.take(K * V), *b = s.take(C), *rd = s.take(C), *te = s.take(C);
    const T* qh = q + n * q_s[0] + hh * q_s[1];
    const T* kh = k + n * k_s[0] + hh * k_s[1];
    const T* vh = v + n * v_s[0] + hh * v_s[1];
    const T* gh = g == nullptr ? nullptr : g + n * g_s[0] + hh * g_s[1];
    if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(T) * K * V);
    else std::fill(h, h + K * V, T(0));
    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      gather_rows(qh, q_s[2], t0, L, C, K, Q, K);
      gather_rows(kh, k_s[2], t0, L, C, K, Km, K);
      gather_rows(vh, v_s[2], t0, L, C, V, Vm, V);
      if (gh != nullptr)
        for (int64_t i = 0; i < C; ++i) b[i] = t0 + i < L ? gh[(t0 + i) * g_s[2]] : T(0);
      if (keep) {
        std::memcpy(qc + row * C * K, Q, sizeof(T) * C * K);
        std::memcpy(kc + row * C * K, Km, sizeof(T) * C * K);
        std::memcpy(vc + row * C * V, Vm, sizeof(T) * C * V);
        if (gh != nullptr) std::memcpy(gc + row * C, b, sizeof(T) * C);
        std::memcpy(states + row * K * V, h, sizeof(T) * K * V);
      }
      mm<T>(false, true, C, C, K, scale, Q, K, Km, K, T(0), P, C);
      causal_mask(C, P);
      const T* kwrite = Km;
      if (gh != nullptr) {
        decay_terms(C, b, rd, te, P, static_cast<T*>(nullptr));
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < K; ++j) {
            Q[i * K + j] *= rd[i];  // Q_b (Q itself is kept above)
            Kbar[i * K + j] = Km[i * K + j] * te[i];
          }
        kwrite = Kbar;
      }
      // O = P V + scale · Q_b h;  h ← e^{b_C} h + K̄ᵀ V
      mm<T>(false, false, C, V, C, T(1), P, C, Vm, V, T(0), O, V);
      mm<T>(false, false, C, V, K, scale, Q, K, h, V, T(1), O, V);
      if (gh != nullptr) {
        const T last = rd[C - 1];
        for (int64_t i = 0; i < K * V; ++i) h[i] *= last;
      }
      mm<T>(true, false, K, V, C, T(1), kwrite, K, Vm, V, T(1), h, V);
      scatter_rows(O, V, C, V, o, n, NC * C, H, hh, t0);
    }
    std::memcpy(h_out + nh * K * V, h, sizeof(T) * K * V);
  }
};

template <typename T>
struct Backward {
  const T *qc, *kc, *vc, *gc, *states, *dout, *dh_final;  // the forward's kept chunks; do head-first
  int64_t do_s[3] = {};
  T *dq, *dk, *dv, *dg, *dh0;  // [N, NC·C, H, ·] (dg [N, NC·C, H]); dh0 [N·H, K, V]
  int64_t N, H, L, K, V, C, NC;
  T scale;

  int64_t scratch_size() const {
    return 6 * round16(C * K) + 2 * round16(C * V) + 3 * round16(C * C) + 2 * round16(K * V) + 4 * round16(C);
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H;
    const bool gated = gc != nullptr;
    Carve<T> s{scratch};
    T *Qb = s.take(C * K), *Kbar = s.take(C * K), *dQb = s.take(C * K), *dKbar = s.take(C * K);
    T *dqc = s.take(C * K), *dkc = s.take(C * K), *dO = s.take(C * V), *dvc = s.take(C * V);
    T *P = s.take(C * C), *G = s.take(C * C), *dP = s.take(C * C);
    T *dh = s.take(K * V), *dh_new = s.take(K * V);
    T *b = s.take(C), *rd = s.take(C), *te = s.take(C), *db = s.take(C);
    const T* doh = dout + n * do_s[0] + hh * do_s[1];
    std::memcpy(dh, dh_final + nh * K * V, sizeof(T) * K * V);
    for (int64_t c = NC - 1; c >= 0; --c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      const T *Q = qc + row * C * K, *Km = kc + row * C * K, *Vm = vc + row * C * V, *h = states + row * K * V;
      gather_rows(doh, do_s[2], t0, L, C, V, dO, V);
      mm<T>(false, true, C, C, K, scale, Q, K, Km, K, T(0), P, C);
      causal_mask(C, P);
      const T *qread = Q, *kwrite = Km;
      T last = T(1);
      if (gated) {
        std::memcpy(b, gc + row * C, sizeof(T) * C);
        decay_terms(C, b, rd, te, P, G);
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < K; ++j) {
            Qb[i * K + j] = Q[i * K + j] * rd[i];
            Kbar[i * K + j] = Km[i * K + j] * te[i];
          }
        qread = Qb;
        kwrite = Kbar;
        last = rd[C - 1];
      }
      // dV = Pᵀ dO + K̄ dh;  dP = dO Vᵀ;  dQ_b = scale · dO hᵀ;  dK̄ = V dhᵀ
      mm<T>(true, false, C, V, C, T(1), P, C, dO, V, T(0), dvc, V);
      mm<T>(false, false, C, V, K, T(1), kwrite, K, dh, V, T(1), dvc, V);
      mm<T>(false, true, C, C, V, T(1), dO, V, Vm, V, T(0), dP, C);
      mm<T>(false, true, C, K, V, scale, dO, V, h, V, T(0), dQb, K);
      mm<T>(false, true, C, K, V, T(1), Vm, V, dh, V, T(0), dKbar, K);
      // dh_c = e^{b_C} dh + scale · Q_bᵀ dO
      for (int64_t i = 0; i < K * V; ++i) dh_new[i] = last * dh[i];
      mm<T>(true, false, K, V, C, scale, qread, K, dO, V, T(1), dh_new, V);
      if (gated) {
        T d_last = T(0), write_sum = T(0);
        for (int64_t i = 0; i < K * V; ++i) d_last += h[i] * dh[i];
        for (int64_t i = 0; i < C; ++i) {
          T rq = T(0), wk = T(0);
          for (int64_t j = 0; j < K; ++j) {
            rq += dQb[i * K + j] * Qb[i * K + j];
            wk += dKbar[i * K + j] * Kbar[i * K + j];
          }
          db[i] = rq - wk;
          write_sum += wk;
        }
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j <= i; ++j) {
            const T e = dP[i * C + j] * P[i * C + j];
            db[i] += e;
            db[j] -= e;
          }
        db[C - 1] += write_sum + d_last * last;
        T run = T(0);
        for (int64_t i = C - 1; i >= 0; --i) {  // dg = reverse cumsum of db inside the chunk
          run += db[i];
          if (t0 + i < L) dg[(n * NC * C + t0 + i) * H + hh] = run;
        }
      }
      // dP ⊙ Γ · scale on the causal triangle; dQ = dQ_b ⊙ e^b + (..) K; dK = dK̄ ⊙ e^{b_C − b} + (..)ᵀ Q
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < C; ++j)
          dP[i * C + j] = j <= i ? dP[i * C + j] * scale * (gated ? G[i * C + j] : T(1)) : T(0);
      for (int64_t i = 0; i < C; ++i) {
        const T fr = gated ? rd[i] : T(1), ft = gated ? te[i] : T(1);
        for (int64_t j = 0; j < K; ++j) {
          dqc[i * K + j] = dQb[i * K + j] * fr;
          dkc[i * K + j] = dKbar[i * K + j] * ft;
        }
      }
      mm<T>(false, false, C, K, C, T(1), dP, C, Km, K, T(1), dqc, K);
      mm<T>(true, false, C, K, C, T(1), dP, C, Q, K, T(1), dkc, K);
      scatter_rows(dqc, K, C, K, dq, n, NC * C, H, hh, t0);
      scatter_rows(dkc, K, C, K, dk, n, NC * C, H, hh, t0);
      scatter_rows(dvc, V, C, V, dv, n, NC * C, H, hh, t0);
      std::swap(dh, dh_new);
    }
    std::memcpy(dh0 + nh * K * V, dh, sizeof(T) * K * V);
  }
};

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V], qc, kc, vc [NC·N·H, C, ·],
// gc [NC·N·H, C]); states and the flattened chunks are what the backward keeps (empty unless keep;
// gc empty without g).
std::vector<torch::Tensor> chunk_linear_attn_fwd(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const c10::optional<torch::Tensor>& g,
                                                 const c10::optional<torch::Tensor>& h0, double scale, int64_t C,
                                                 bool keep) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "chunk_linear_attn_fwd: q, k, v must be [N, H, T, ·]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "chunk_linear_attn_fwd: last dims must be unit-stride");
  TORCH_CHECK(C > 0 && C <= 1024, "chunk_linear_attn_fwd: chunk size must be in [1, 1024], got ", C);
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(), "chunk_linear_attn_fwd: one dtype");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  auto opts = v.options();
  torch::Tensor o = torch::empty({N, NC * C, H, V}, opts), h_out = torch::empty({N * H, K, V}, opts);
  torch::Tensor states, qc, kc, vc, gc;
  if (keep) {
    states = torch::empty({NC, N * H, K, V}, opts);
    qc = torch::empty({NC * N * H, C, K}, opts);
    kc = torch::empty({NC * N * H, C, K}, opts);
    vc = torch::empty({NC * N * H, C, V}, opts);
  } else {
    states = qc = kc = vc = torch::empty({0}, opts);
  }
  gc = keep && g.has_value() ? torch::empty({NC * N * H, C}, opts) : torch::empty({0}, opts);
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Forward<T> f;
    f.q = q.data_ptr<T>();
    f.k = k.data_ptr<T>();
    f.v = v.data_ptr<T>();
    f.g = g.has_value() ? g->data_ptr<T>() : nullptr;
    f.h0 = h0.has_value() ? h0c.data_ptr<T>() : nullptr;
    strides3(q, f.q_s);
    strides3(k, f.k_s);
    strides3(v, f.v_s);
    if (g.has_value()) strides3(*g, f.g_s);
    f.o = o.data_ptr<T>();
    f.h_out = h_out.data_ptr<T>();
    f.states = keep ? states.data_ptr<T>() : nullptr;
    f.qc = keep ? qc.data_ptr<T>() : nullptr;
    f.kc = keep ? kc.data_ptr<T>() : nullptr;
    f.vc = keep ? vc.data_ptr<T>() : nullptr;
    f.gc = keep && g.has_value() ? gc.data_ptr<T>() : nullptr;
    f.N = N; f.H = H; f.L = L; f.K = K; f.V = V; f.C = C; f.NC = NC;
    f.scale = T(scale);
    f.keep = keep;
    per_head(f);
  };
  fp32_or_fp64(v.scalar_type(), "chunk_linear_attn_fwd", run);
  return {o, h_out, states, qc, kc, vc, gc};
}

// Returns (dq, dk, dv [N, NC·C, H, ·], dg [N, NC·C, H] (empty without g), dh0 [N·H, K, V]).
std::vector<torch::Tensor> chunk_linear_attn_bwd(const torch::Tensor& qc, const torch::Tensor& kc,
                                                 const torch::Tensor& vc, const c10::optional<torch::Tensor>& gc,
                                                 const torch::Tensor& states, const torch::Tensor& dout,
                                                 const torch::Tensor& dh_final, double scale, int64_t C) {
  TORCH_CHECK(qc.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && states.is_contiguous() &&
              (!gc.has_value() || gc->is_contiguous()), "chunk_linear_attn_bwd: the kept tensors must be contiguous");
  TORCH_CHECK(dout.dim() == 4 && dout.stride(3) == 1, "chunk_linear_attn_bwd: do must be [N, H, T, V], unit last stride");
  const int64_t N = dout.size(0), H = dout.size(1), L = dout.size(2), NC = states.size(0);
  const int64_t K = states.size(2), V = states.size(3);
  auto opts = states.options();
  torch::Tensor dq = torch::empty({N, NC * C, H, K}, opts), dk = torch::empty({N, NC * C, H, K}, opts);
  torch::Tensor dv = torch::empty({N, NC * C, H, V}, opts), dh0 = torch::empty({N * H, K, V}, opts);
  torch::Tensor dg = gc.has_value() ? torch::zeros({N, NC * C, H}, opts) : torch::empty({0}, opts);
  torch::Tensor dhf = dh_final.contiguous();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Backward<T> b;
    b.qc = qc.data_ptr<T>();
    b.kc = kc.data_ptr<T>();
    b.vc = vc.data_ptr<T>();
    b.gc = gc.has_value() ? gc->data_ptr<T>() : nullptr;
    b.states = states.data_ptr<T>();
    b.dout = dout.data_ptr<T>();
    b.dh_final = dhf.data_ptr<T>();
    strides3(dout, b.do_s);
    b.dq = dq.data_ptr<T>();
    b.dk = dk.data_ptr<T>();
    b.dv = dv.data_ptr<T>();
    b.dg = gc.has_value() ? dg.data_ptr<T>() : nullptr;
    b.dh0 = dh0.data_ptr<T>();
    b.N = N; b.H = H; b.L = L; b.K = K; b.V = V; b.C = C; b.NC = NC;
    b.scale = T(scale);
    per_head(b);
  };
  fp32_or_fp64(states.scalar_type(), "chunk_linear_attn_bwd", run);
  return {dq, dk, dv, dg, dh0};
}

}  // namespace

void register_chunk_linear_attn(pybind11::module& m) {
  m.def("chunk_linear_attn_fwd", &chunk_linear_attn_fwd, "linear attention's chunk forward, one task per (sequence, head)");
  m.def("chunk_linear_attn_bwd", &chunk_linear_attn_bwd, "its backward, last chunk first");
}
