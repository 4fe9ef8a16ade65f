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

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

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

// Scratch of one task: 64-byte aligned, so BLAS sees the same alignment for every head.
template <typename T>
struct Scratch {
  T* base = nullptr;
  explicit Scratch(size_t n) {
    size_t bytes = ((n * sizeof(T) + 63) / 64) * 64;
    base = static_cast<T*>(std::aligned_alloc(64, bytes));
    TORCH_CHECK(base != nullptr, "chunk_delta_rule (CPU kernel): out of memory for ", bytes, " bytes of scratch");
  }
  ~Scratch() { std::free(base); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // keeps every scratch matrix 64-byte aligned

template <typename T>
struct Forward {
  // inputs, head-first [N, H, T, ·] with unit stride in the last dim; strides (n, h, t) in elements
  const T *q, *k, *v, *beta, *g, *h0;
  int64_t q_s[3], k_s[3], v_s[3], beta_s[3], g_s[3];
  // outputs
  T* o;       // [N, NC·C, H, V] contiguous
  T* h_out;   // [N·H, K, V]
  T* states;  // [NC, N·H, K, V]: the state entering each chunk
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
    const T* qh = q + n * q_s[0] + hh * q_s[1];
    const T* kh = k + n * k_s[0] + hh * k_s[1];
    const T* vh = v + n * v_s[0] + hh * v_s[1];
    const T* bh = beta + n * beta_s[0] + hh * beta_s[1];
    const T* gh = g == nullptr ? nullptr : g + n * g_s[0] + hh * g_s[1];
    const bool gated = gh != nullptr;

    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C, rows = std::min(C, L - t0), row = c * NH + nh;
      // gather the chunk (zero rows past the end: a no-op token for the rule)
      for (int64_t i = 0; i < C; ++i) {
        if (i < rows) {
          const int64_t t = t0 + i;
          std::memcpy(Q + i * K, qh + t * q_s[2], sizeof(T) * K);
          std::memcpy(KVm + i * KV, kh + t * k_s[2], sizeof(T) * K);
          std::memcpy(KVm + i * KV + K, vh + t * v_s[2], sizeof(T) * V);
          bvec[i] = bh[t * beta_s[2]];
          bcum[i] = gated ? gh[t * g_s[2]] : T(0);
        } else {
          std::fill(Q + i * K, Q + (i + 1) * K, T(0));
          std::fill(KVm + i * KV, KVm + (i + 1) * KV, T(0));
          bvec[i] = T(0);
          bcum[i] = T(0);
        }
      }
      if (gated) {
        for (int64_t i = 1; i < C; ++i) bcum[i] += bcum[i - 1];
        for (int64_t i = 0; i < C; ++i) {
          rd[i] = std::exp(bcum[i]);
          te[i] = std::exp(bcum[C - 1] - bcum[i]);
        }
      }
      // S = K Kᵀ and P = scale · Q Kᵀ, then their masks and decays
      mm<T>(false, true, C, C, K, T(1), KVm, KV, KVm, KV, T(0), S, C);
      mm<T>(false, true, C, C, K, scale, Q, K, KVm, KV, T(0), P, C);
      for (int64_t i = 0; i < C; ++i) {
        T* s = S + i * C;
        T* p = P + i * C;
        if (gated) {
          for (int64_t j = 0; j <= i; ++j) {
            const T gam = std::exp(bcum[i] - bcum[j]);
            p[j] *= gam;
            s[j] *= gam;
          }
        }
        std::fill(s + i, s + C, T(0));
        std::fill(p + i + 1, p + C, T(0));
      }
      // T = (I + diag(β) S)⁻¹, row by row: T_r = e_r − β_r Σ_{i<r} S[r, i] T_i
      std::fill(Tm, Tm + C * C, T(0));
      for (int64_t r = 0; r < C; ++r) {
        T* tr = Tm + r * C;
        const T* s = S + r * C;
        for (int64_t i = 0; i < r; ++i) {
          const T a = -bvec[r] * s[i];
          const T* ti = Tm + i * C;
          for (int64_t j = 0; j <= i; ++j) tr[j] += a * ti[j];
        }
        tr[r] = T(1);
      }
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
      std::memcpy(states + row * K * V, h, sizeof(T) * K * V);
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
      mm<T>(false, false, C, V, K, scale, qread, gated ? K : K, h, V, T(0), O, V);
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
  int64_t s4[4];
  for (int i = 0; i < 3; ++i) {
    f.q_s[i] = q.stride(i);
    f.k_s[i] = k.stride(i);
    f.v_s[i] = v.stride(i);
  }
  (void)s4;
  strides3(beta, f.beta_s);
  if (g.has_value()) strides3(*g, f.g_s);
  f.o = o.data_ptr<T>();
  f.h_out = h_out.data_ptr<T>();
  f.states = states.data_ptr<T>();
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
  const int64_t tasks = f.N * f.H, size = f.scratch_size();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int previous = MKL_Set_Num_Threads_Local(1);  // one core per head, whatever the caller's threads
    Scratch<T> scratch(size);
    for (int64_t nh = begin; nh < end; ++nh) f.head(nh, scratch.base);
    MKL_Set_Num_Threads_Local(previous);
  });
}

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V], q_flat, kv_flat, wu, inverses);
// the last four are empty unless keep.
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
  torch::Tensor states = torch::empty({NC, N * H, K, V}, opts);
  torch::Tensor q_flat, kv_flat, wu, inverses;
  if (keep) {
    q_flat = torch::empty({rows, C, K}, opts);
    kv_flat = torch::empty({rows, C, K + V}, opts);
    wu = torch::empty({rows, C, K + V}, opts);
    inverses = torch::empty({nb, rows, bs, bs}, opts);
  } else {
    q_flat = kv_flat = wu = inverses = torch::empty({0}, opts);
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

}  // namespace

void register_gemm_bf16(pybind11::module& m);  // gemm_bf16_check.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("chunk_delta_fwd", &chunk_delta_fwd, "the (gated) delta rule's chunk forward, one task per (sequence, head)");
  register_gemm_bf16(m);
}
