// One decode token of the (gated) delta rule on the CPU: the state read once and written once.
//
// Per head, with the state h [K, V] (row-major), α = exp(g) (1 without a gate):
//   a = hᵀk, r = hᵀq                          pass 1: one read of h
//   u = β (v − α a)                           the delta write's value
//   o = scale · (α r + (kᵀq) u)               = scale · h'ᵀq, assembled from the reads
//   h' = α h + k uᵀ                           pass 2: over h again, now in the core's cache
// This is the algebra of `delta_update` in fastweights/ops/step.py (the delta rule:
// Schlag et al. 2021, arXiv:2102.11174; its gated form: Yang et al. 2024, arXiv:2412.06464).
// The PyTorch step moves the whole state through memory several times (the batched read,
// the decay, the rank-one write); here one head's state (64 KB at K = V = 128, fp32) is
// read from memory once, and the second pass finds it in L1/L2.
//
// Batch invariance: a head touches only its own rows of every tensor and its arithmetic
// (the order of every sum) is fixed by K and V alone, so its results do not depend on the
// other heads, the batch size or the thread that ran it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// Columns per register tile: a whole row of 512 bytes (128 floats, 64 doubles) with AVX-512's
// 32 vector registers, so the two read accumulators (or the write's u) of a tile stay in
// registers while a pass walks down the rows; 128 bytes with 16 (AVX2).
#ifdef __AVX512F__
constexpr int64_t kTileBytes = 512;
#else
constexpr int64_t kTileBytes = 128;
#endif
template <typename T>
constexpr int64_t kTile = kTileBytes / sizeof(T);

// Pass 1 on the columns [j0, j0 + w) of a head (w = W, a compile-time tile whose accumulators
// stay in registers, or, with W = 0, the w < kTile columns at the end, accumulated in a and r):
// a[j] = Σ_i k[i] h[i, j], r[j] = Σ_i q[i] h[i, j], summed in row order.
template <typename T, int64_t W>
inline void read_cols(const T* __restrict h, int64_t K, int64_t V, int64_t w, const T* __restrict k,
                      const T* __restrict q, T* __restrict a, T* __restrict r) {
  T a_tile[W > 0 ? W : 1], r_tile[W > 0 ? W : 1];
  T* __restrict ak = W > 0 ? a_tile : a;
  T* __restrict rq = W > 0 ? r_tile : r;
  if constexpr (W > 0) w = W;
  for (int64_t j = 0; j < w; ++j) ak[j] = rq[j] = T(0);
  for (int64_t i = 0; i < K; ++i) {
    const T ki = k[i], qi = q[i];
    const T* __restrict row = h + i * V;
    for (int64_t j = 0; j < w; ++j) {
      ak[j] += ki * row[j];
      rq[j] += qi * row[j];
    }
  }
  if constexpr (W > 0) {
    for (int64_t j = 0; j < W; ++j) {
      a[j] = ak[j];
      r[j] = rq[j];
    }
  }
}

// One row of pass 2 on w columns: d = α s + k_i u (α only with a gate); in place, d itself.
template <typename T, bool G>
inline void write_row(const T* __restrict s, T* __restrict d, int64_t w, T ki, const T* __restrict u, T alpha) {
  for (int64_t j = 0; j < w; ++j) d[j] = (G ? alpha * s[j] : s[j]) + ki * u[j];
}
template <typename T, bool G>
inline void write_row(T* __restrict d, int64_t w, T ki, const T* __restrict u, T alpha) {
  for (int64_t j = 0; j < w; ++j) d[j] = (G ? alpha * d[j] : d[j]) + ki * u[j];
}

// Pass 2 on the columns [j0, j0 + w) of a head (w = W, a compile-time tile with u held in
// registers down the rows, or fewer columns at the end).
template <typename T, int64_t W, bool G, bool InPlace>
inline void write_cols(const T* src, T* dst, int64_t K, int64_t V, int64_t w, const T* __restrict k,
                       const T* __restrict u, T alpha) {
  T ut[W > 0 ? W : 1];
  const T* uu = u;
  if constexpr (W > 0) {
    for (int64_t j = 0; j < W; ++j) ut[j] = u[j];
    uu = ut;
    w = W;
  }
  for (int64_t i = 0; i < K; ++i) {
    if constexpr (InPlace) write_row<T, G>(dst + i * V, w, k[i], uu, alpha);
    else write_row<T, G>(src + i * V, dst + i * V, w, k[i], uu, alpha);
  }
}

template <typename T>
struct Step {
  const T *q, *k, *v, *beta, *g;  // rows of q, k [NH, ·K], v [NH, ·V] (unit stride within a row), beta, g [NH]
  int64_t q_s, k_s, v_s, beta_s, g_s;
  const T* h;  // [NH, K, V] contiguous
  T* h_out;    // [NH, K, V] contiguous; h itself when in place
  T* o;        // [NH, V] contiguous
  int64_t K, V;
  T scale;

  // scratch: a, r, u, each V long
  template <bool G, bool InPlace>
  void head(int64_t nh, T* __restrict a, T* __restrict r, T* __restrict u) const {
    head_at<G, InPlace>(nh, h + nh * K * V, h_out + nh * K * V, a, r, u);
  }

  // Row nh of the inputs with its state read from hh and written to ho (the same memory when in place).
  template <bool G, bool InPlace>
  void head_at(int64_t nh, const T* hh, T* ho, T* __restrict a, T* __restrict r, T* __restrict u) const {
    constexpr int64_t W = kTile<T>;
    const T* __restrict kh = k + nh * k_s;
    const T* __restrict qh = q + nh * q_s;
    const T* __restrict vh = v + nh * v_s;
    const T b = beta[nh * beta_s];
    const T alpha = G ? std::exp(g[nh * g_s]) : T(1);

    int64_t j0 = 0;
    for (; j0 + W <= V; j0 += W) read_cols<T, W>(hh + j0, K, V, W, kh, qh, a + j0, r + j0);
    if (j0 < V) read_cols<T, 0>(hh + j0, K, V, V - j0, kh, qh, a + j0, r + j0);

    T kq = T(0);
    for (int64_t i = 0; i < K; ++i) kq += kh[i] * qh[i];
    T* __restrict oh = o + nh * V;
    for (int64_t j = 0; j < V; ++j) {
      u[j] = b * (vh[j] - (G ? alpha * a[j] : a[j]));             // β (v − (α h)ᵀk)
      oh[j] = scale * ((G ? alpha * r[j] : r[j]) + kq * u[j]);    // scale · h'ᵀq
    }

    for (j0 = 0; j0 + W <= V; j0 += W) write_cols<T, W, G, InPlace>(hh + j0, ho + j0, K, V, W, kh, u + j0, alpha);
    if (j0 < V) write_cols<T, 0, G, InPlace>(hh + j0, ho + j0, K, V, V - j0, kh, u + j0, alpha);
  }
};

// [N, H, ·] (or [N, H]) -> [N·H, ·] (or [N·H]) in dtype dt, unit stride in the last dim.
torch::Tensor rows(const torch::Tensor& t, at::ScalarType dt, int64_t nh, int64_t width) {
  torch::Tensor r = t.to(dt).reshape(width < 0 ? at::IntArrayRef{nh} : at::IntArrayRef{nh, width});
  return width >= 0 && r.stride(1) != 1 ? r.contiguous() : r;
}

// One token's inputs as rows of the state's dtype: q, k [N·H, K], v [N·H, V], beta, g [N·H].
struct TokenRows {
  torch::Tensor q, k, v, beta;
  c10::optional<torch::Tensor> g;
};

// q, k [N, H, K], v [N, H, V], beta, g [N, H] (g optional), on the CPU; `op` and `holder` name the
// function and the tensor (state or pool) whose sizes they must match in the message.
TokenRows token_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& beta,
                     const c10::optional<torch::Tensor>& g, at::ScalarType dt, int64_t N, int64_t H, int64_t K,
                     int64_t V, const char* op, const char* holder) {
  TORCH_CHECK(q.sizes() == at::IntArrayRef({N, H, K}) && k.sizes() == q.sizes() &&
                  v.sizes() == at::IntArrayRef({N, H, V}) && beta.sizes() == at::IntArrayRef({N, H}) &&
                  (!g.has_value() || g->sizes() == beta.sizes()),
              op, ": the shapes do not match the ", holder, "'s");
  for (const torch::Tensor* t : {&q, &k, &v, &beta}) TORCH_CHECK(t->is_cpu(), op, ": every tensor must be on the CPU");
  TORCH_CHECK(!g.has_value() || g->is_cpu(), op, ": every tensor must be on the CPU");
  const int64_t NH = N * H;
  TokenRows in{rows(q, dt, NH, K), rows(k, dt, NH, K), rows(v, dt, NH, V), rows(beta, dt, NH, -1), c10::nullopt};
  if (g.has_value()) in.g = rows(*g, dt, NH, -1);
  return in;
}

// The Step over `in`, writing o [N·H, V]; the state pointers (h, h_out) are left to the caller.
template <typename T>
Step<T> make_step(const TokenRows& in, torch::Tensor& o, int64_t K, int64_t V, double scale) {
  Step<T> s;
  s.q = in.q.data_ptr<T>();
  s.k = in.k.data_ptr<T>();
  s.v = in.v.data_ptr<T>();
  s.beta = in.beta.data_ptr<T>();
  s.g = in.g.has_value() ? in.g->data_ptr<T>() : nullptr;
  s.q_s = in.q.stride(0);
  s.k_s = in.k.stride(0);
  s.v_s = in.v.stride(0);
  s.beta_s = in.beta.stride(0);
  s.g_s = in.g.has_value() ? in.g->stride(0) : 0;
  s.h = nullptr;
  s.h_out = nullptr;
  s.o = o.data_ptr<T>();
  s.K = K;
  s.V = V;
  s.scale = T(scale);
  return s;
}

template <typename T>
void run_step(const TokenRows& in, const torch::Tensor& h, torch::Tensor& h_out, torch::Tensor& o, double scale) {
  Step<T> s = make_step<T>(in, o, h.size(1), h.size(2), scale);
  s.h = h.data_ptr<T>();
  s.h_out = h_out.data_ptr<T>();
  const int64_t V = s.V;
  const bool in_place = s.h_out == s.h;
  at::parallel_for(0, h.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(3 * V);
    T *a = scratch.data(), *r = a + V, *u = r + V;
    for (int64_t nh = begin; nh < end; ++nh) {
      if (s.g != nullptr) {
        if (in_place) s.template head<true, true>(nh, a, r, u);
        else s.template head<true, false>(nh, a, r, u);
      } else {
        if (in_place) s.template head<false, true>(nh, a, r, u);
        else s.template head<false, false>(nh, a, r, u);
      }
    }
  });
}

// One token: q, k [N, H, K], v [N, H, V], beta, g [N, H] (any float dtype: cast to the state's),
// state [N, H, K, V] contiguous float32 or float64 (shapes checked by the caller). Returns
// (o [N, H, V] in v's dtype, h'): h' is the state itself, updated, when in place, else a new tensor.
std::vector<torch::Tensor> delta_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      const torch::Tensor& beta, const c10::optional<torch::Tensor>& g,
                                      const torch::Tensor& state, double scale, bool inplace) {
  TORCH_CHECK(state.dim() == 4 && state.is_contiguous(), "delta_step: the state must be a contiguous [N, H, K, V] tensor");
  const auto dt = state.scalar_type();
  TORCH_CHECK(dt == torch::kFloat || dt == torch::kDouble, "delta_step: a float32 or float64 state only");
  const int64_t N = state.size(0), H = state.size(1), K = state.size(2), V = state.size(3), NH = N * H;
  const TokenRows in = token_rows(q, k, v, beta, g, dt, N, H, K, V, "delta_step", "state");
  torch::Tensor h = state.view({NH, K, V});
  torch::Tensor h_out = inplace ? h : torch::empty_like(h);
  torch::Tensor o = torch::empty({N, H, V}, state.options());
  if (dt == torch::kFloat) run_step<float>(in, h, h_out, o, scale);
  else run_step<double>(in, h, h_out, o, scale);
  return {o.to(v.scalar_type()), inplace ? state : h_out.view({N, H, K, V})};
}

// The pool form (fastweights/ops/state_pool.py): row n's state is the pool's slot slots[n], read and
// written in place where it lies (no gathered copy). A slot of -1 starts from zeros in a scratch
// state that is dropped; fresh[n] (optional) starts slot slots[n] from zeros. The caller checks the
// slots (in range, no slot twice: each head's memory belongs to one task).
template <typename T>
void run_pool_step(const TokenRows& in, torch::Tensor& pool, const torch::Tensor& slots,
                   const c10::optional<torch::Tensor>& fresh, torch::Tensor& o, double scale, int64_t H) {
  const Step<T> s = make_step<T>(in, o, pool.size(2), pool.size(3), scale);
  const int64_t K = s.K, V = s.V, KV = K * V;
  T* base = pool.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const bool* has_init = fresh.has_value() ? fresh->data_ptr<bool>() : nullptr;
  const int64_t NH = in.q.size(0);
  at::parallel_for(0, NH, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scratch(3 * V);
    std::vector<T> dropped;  // the state of a row without a slot
    T *a = scratch.data(), *r = a + V, *u = r + V;
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, sl = slot[n];
      T* hh;
      if (sl < 0) {
        dropped.assign(KV, T(0));
        hh = dropped.data();
      } else {
        hh = base + (sl * H + nh % H) * KV;
        if (has_init != nullptr && !has_init[n]) std::fill(hh, hh + KV, T(0));
      }
      if (s.g != nullptr) s.template head_at<true, true>(nh, hh, hh, a, r, u);
      else s.template head_at<false, true>(nh, hh, hh, a, r, u);
    }
  });
}

// One token for N sessions held in a pool: q, k [N, H, K], v [N, H, V], beta, g [N, H], pool
// [S, H, K, V] contiguous float32/float64, slots int64 [N] in [-1, S) without repeats (checked by
// the caller), has_initial_state bool [N] or None. Updates the pool in place; returns o [N, H, V].
torch::Tensor delta_step_pool(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& beta, const c10::optional<torch::Tensor>& g, torch::Tensor& pool,
                              const torch::Tensor& slots, const c10::optional<torch::Tensor>& has_initial_state,
                              double scale) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && pool.is_cpu(),
              "delta_step_pool: the pool must be a contiguous CPU [S, H, K, V] tensor");
  const auto dt = pool.scalar_type();
  TORCH_CHECK(dt == torch::kFloat || dt == torch::kDouble, "delta_step_pool: a float32 or float64 pool only");
  const int64_t H = pool.size(1), K = pool.size(2), V = pool.size(3), N = q.size(0);
  const TokenRows in = token_rows(q, k, v, beta, g, dt, N, H, K, V, "delta_step_pool", "pool");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == N && slots.is_cpu(),
              "delta_step_pool: state_indices must be a CPU int64 [N] tensor");
  c10::optional<torch::Tensor> fresh;
  if (has_initial_state.has_value()) fresh = has_initial_state->to(torch::kBool).contiguous();
  torch::Tensor idx = slots.contiguous();
  torch::Tensor o = torch::empty({N, H, V}, pool.options());
  if (dt == torch::kFloat) run_pool_step<float>(in, pool, idx, fresh, o, scale, H);
  else run_pool_step<double>(in, pool, idx, fresh, o, scale, H);
  return o.to(v.scalar_type());
}

}  // namespace

void register_decode_step(pybind11::module& m) {  // called by chunk_delta.cpp's PYBIND11_MODULE
  m.def("delta_step", &delta_step, "one decode token of the (gated) delta rule, one task per head");
  m.def("delta_step_pool", &delta_step_pool,
        "one decode token of the (gated) delta rule for sessions held in a state pool, in place at their slots");
}
