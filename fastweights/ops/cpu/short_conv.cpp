// The short (causal depthwise) convolution of the fast-weight layers, forward and backward,
// on the CPU: fastweights/layers/common.py's _CausalConv without its copies.
//
//   y[b, t, c] = Σ_i taps[i, c] · P[b, t + i, c],   P = [state | x]   (state: the W − 1 rows before x)
//
// The PyTorch version concatenates [state | x] (a copy kept for the backward), then makes W passes
// over the activations forward and about 3·W backward (a zero fill, W shifted adds, W products and
// W reductions for the taps' gradient). Here the forward and d[state | x] are one pass over rows
// (a row's W products stay in the core's cache), and the taps' gradient is one pass over dy and P
// per block of channels, summed in a fixed order whatever the number of threads (deterministic,
// and the same on one thread and on two).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kRows = 16;   // time steps per task of the forward and of dx
constexpr int64_t kBlock = 64;  // channels per task of the taps' gradient

// Row t + i of P = [state | x] for sequence b (i counted from the oldest tap).
template <typename T>
inline const T* p_row(const T* xb, const T* sb, int64_t s, int64_t W, int64_t C) {
  return s >= 0 ? xb + s * C : sb + (W - 1 + s) * C;
}

template <typename T>
void conv_forward(const T* x, const T* st, const T* taps, T* y, int64_t B, int64_t L, int64_t C, int64_t W) {
  const int64_t blocks = (L + kRows - 1) / kRows;
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, t0 = (task % blocks) * kRows, t1 = std::min(L, t0 + kRows);
      const T* xb = x + b * L * C;
      const T* sb = st + b * (W - 1) * C;
      for (int64_t t = t0; t < t1; ++t) {
        T* out = y + (b * L + t) * C;
        const T* row = xb + t * C;  // the newest input, tap W − 1, first (the PyTorch version's order)
        const T* tap = taps + (W - 1) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) out[c] = tap[c] * row[c];
        for (int64_t i = W - 2; i >= 0; --i) {
          const T* r = p_row(xb, sb, t + i - (W - 1), W, C);
          const T* tp = taps + i * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) out[c] += tp[c] * r[c];
        }
      }
    }
  });
}

template <typename T>
void conv_backward(const T* dy, const T* x, const T* st, const T* taps, T* dx, T* dst, T* dtaps, int64_t B,
                   int64_t L, int64_t C, int64_t W) {
  // d[state | x] row r = Σ_i dy[r − i] · tap i, rows of (b, block of r) per task
  const int64_t R = W - 1 + L, blocks = (R + kRows - 1) / kRows;
  at::parallel_for(0, B * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, r0 = (task % blocks) * kRows, r1 = std::min(R, r0 + kRows);
      const T* dyb = dy + b * L * C;
      for (int64_t r = r0; r < r1; ++r) {
        T* out = r < W - 1 ? dst + (b * (W - 1) + r) * C : dx + (b * L + r - (W - 1)) * C;
        bool first = true;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t t = r - i;
          if (t < 0 || t >= L) continue;
          const T* g = dyb + t * C;
          const T* tp = taps + i * C;
          if (first) {
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) out[c] = g[c] * tp[c];
            first = false;
          } else {
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) out[c] += g[c] * tp[c];
          }
        }
        if (first) std::fill(out, out + C, T(0));
      }
    }
  });
  // dtaps[i] = Σ_b Σ_t dy[t] · P[t + i], per block of channels: a fixed order whatever the threads
  const int64_t cblocks = (C + kBlock - 1) / kBlock;
  at::parallel_for(0, cblocks, 1, [&](int64_t begin, int64_t end) {
    T acc[16][kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock, n = std::min(kBlock, C - c0);
      for (int64_t i = 0; i < W; ++i) std::fill(acc[i], acc[i] + kBlock, T(0));
      for (int64_t b = 0; b < B; ++b) {
        const T* xb = x + b * L * C + c0;
        const T* sb = st + b * (W - 1) * C + c0;
        const T* dyb = dy + b * L * C + c0;
        for (int64_t t = 0; t < L; ++t) {
          const T* g = dyb + t * C;
          for (int64_t i = 0; i < W; ++i) {
            const T* r = p_row(xb, sb, t + i - (W - 1), W, C);
            T* a = acc[i];
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) a[c] += g[c] * r[c];
          }
        }
      }
      for (int64_t i = 0; i < W; ++i) std::memcpy(dtaps + i * C + c0, acc[i], sizeof(T) * n);
    }
  });
}

void check(const torch::Tensor& x, const torch::Tensor& st, const torch::Tensor& taps) {
  TORCH_CHECK(x.dim() == 3 && st.dim() == 3 && taps.dim() == 2, "short_conv: x [B, T, C], state [B, W-1, C], taps [W, C]");
  TORCH_CHECK(x.is_contiguous() && st.is_contiguous() && taps.is_contiguous(), "short_conv: contiguous tensors only");
  TORCH_CHECK(taps.size(0) <= 16, "short_conv: at most 16 taps");
  TORCH_CHECK(st.size(0) == x.size(0) && st.size(1) == taps.size(0) - 1 && st.size(2) == x.size(2) &&
              taps.size(1) == x.size(2), "short_conv: mismatched shapes");
  TORCH_CHECK(x.scalar_type() == st.scalar_type() && x.scalar_type() == taps.scalar_type() &&
              (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kDouble), "short_conv: float32 or float64, one dtype");
}

torch::Tensor short_conv_fwd(const torch::Tensor& x, const torch::Tensor& st, const torch::Tensor& taps) {
  check(x, st, taps);
  torch::Tensor y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "short_conv_fwd", [&] {
    conv_forward<scalar_t>(x.data_ptr<scalar_t>(), st.data_ptr<scalar_t>(), taps.data_ptr<scalar_t>(),
                           y.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), taps.size(0));
  });
  return y;
}

std::vector<torch::Tensor> short_conv_bwd(const torch::Tensor& dy, const torch::Tensor& x, const torch::Tensor& st,
                                          const torch::Tensor& taps) {
  check(x, st, taps);
  TORCH_CHECK(dy.sizes() == x.sizes() && dy.scalar_type() == x.scalar_type(), "short_conv_bwd: dy like x");
  torch::Tensor g = dy.contiguous();
  torch::Tensor dx = torch::empty_like(x), dst = torch::empty_like(st), dtaps = torch::empty_like(taps);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "short_conv_bwd", [&] {
    conv_backward<scalar_t>(g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), st.data_ptr<scalar_t>(),
                            taps.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), dst.data_ptr<scalar_t>(),
                            dtaps.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), taps.size(0));
  });
  return {dx, dst, dtaps};
}

}  // namespace

void register_short_conv(pybind11::module& m) {
  m.def("short_conv_fwd", &short_conv_fwd, "the causal depthwise convolution over [state | x]");
  m.def("short_conv_bwd", &short_conv_bwd, "its backward: (dx, dstate, dtaps)");
}
