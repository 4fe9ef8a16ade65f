// The short (causal depthwise) convolution of the fast-weight layers, forward and backward,
// on the CPU: fastweights/layers/common.py's _CausalConv without its copies.
//
//   y[b, t, c] = Σ_i taps[i, c] · P[b, t + i, c],   P = [state | x]   (state: the W − 1 rows before x)
//
// The PyTorch version concatenates [state | x] (a copy kept for the backward), then makes W passes
// over the activations forward and about 3·W backward (a zero fill, W shifted adds, W products and
// W reductions for the taps' gradient). Here each pass is one loop over a block of channels with the
// W taps in registers: the forward reads x once, the backward reads dy and P once. A task is a block
// of channels over the whole batch, so the taps' gradient sums in a fixed order whatever the number
// of threads (deterministic, and the same on one thread and on two).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kBlock = 32;  // channels per task

template <typename T>
void conv_forward(const T* x, const T* st, const T* taps, T* y, int64_t B, int64_t L, int64_t C, int64_t W) {
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks * B, 1, [&](int64_t begin, int64_t end) {
    T acc[kBlock];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, c0 = (task % blocks) * kBlock, n = std::min(kBlock, C - c0);
      const T* xb = x + b * L * C + c0;
      const T* sb = st + b * (W - 1) * C + c0;
      T* yb = y + b * L * C + c0;
      for (int64_t t = 0; t < L; ++t) {
        std::fill(acc, acc + kBlock, T(0));
        for (int64_t i = W - 1; i >= 0; --i) {  // the PyTorch version's order: the newest input first
          const int64_t s = t + i - (W - 1);
          const T* row = s >= 0 ? xb + s * C : sb + (W - 1 + s) * C;
          const T* tap = taps + i * C + c0;
#pragma omp simd
          for (int64_t c = 0; c < n; ++c) acc[c] += tap[c] * row[c];
        }
        std::memcpy(yb + t * C, acc, sizeof(T) * n);
      }
    }
  });
}

template <typename T>
void conv_backward(const T* dy, const T* x, const T* st, const T* taps, T* dx, T* dst, T* dtaps, int64_t B,
                   int64_t L, int64_t C, int64_t W) {
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    T acc[kBlock], dtap[16][kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock, n = std::min(kBlock, C - c0);
      for (int64_t i = 0; i < W; ++i) std::fill(dtap[i], dtap[i] + kBlock, T(0));
      for (int64_t b = 0; b < B; ++b) {
        const T* dyb = dy + b * L * C + c0;
        const T* xb = x + b * L * C + c0;
        const T* sb = st + b * (W - 1) * C + c0;
        // row r of P = [state | x] collects dy[r − i] · tap i; r < W − 1 are the state's rows
        for (int64_t r = 0; r < W - 1 + L; ++r) {
          std::fill(acc, acc + kBlock, T(0));
          for (int64_t i = 0; i < W; ++i) {
            const int64_t t = r - i;
            if (t < 0 || t >= L) continue;
            const T* g = dyb + t * C;
            const T* tap = taps + i * C + c0;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) acc[c] += g[c] * tap[c];
          }
          T* out = r < W - 1 ? dst + (b * (W - 1) + r) * C + c0 : dx + (b * L + r - (W - 1)) * C + c0;
          std::memcpy(out, acc, sizeof(T) * n);
        }
        // dtaps[i] += Σ_t dy[t] · P[t + i]
        for (int64_t t = 0; t < L; ++t) {
          const T* g = dyb + t * C;
          for (int64_t i = 0; i < W; ++i) {
            const int64_t s = t + i - (W - 1);
            const T* row = s >= 0 ? xb + s * C : sb + (W - 1 + s) * C;
#pragma omp simd
            for (int64_t c = 0; c < n; ++c) dtap[i][c] += g[c] * row[c];
          }
        }
      }
      for (int64_t i = 0; i < W; ++i) std::memcpy(dtaps + i * C + c0, dtap[i], sizeof(T) * n);
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
