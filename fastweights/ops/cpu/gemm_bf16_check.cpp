// Python entry points of gemm_bf16.h, for its tests and its benchmark (the forward itself calls
// the header from C++): gemm_bf16_check runs one call on torch tensors, to_bf16_check the
// conversion, gemm_bf16_bench times the kernel against the fp32 product (gemm.h: MKL's sgemm_,
// or the portable loop) on the same shape, each on the path the ISA level (isa.h) selects; and
// exp_check, chunk_rows.h's exp_of (the KDA kernels' exponentials) on that path.
#include <torch/extension.h>

#include <time.h>

#include <string>
#include <vector>

#include "chunk_rows.h"
#include "gemm_bf16.h"

namespace {

using fastweights::cpu::gemm_bf16;
using fastweights::cpu::Workspace;

void check_matrix(const torch::Tensor& t, const char* name, c10::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2, "gemm_bf16_check: `", name, "` must be 2-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == dtype, "gemm_bf16_check: `", name, "` must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.stride(1) == 1 || t.size(1) <= 1, "gemm_bf16_check: `", name, "` needs unit stride in its last dim");
  TORCH_CHECK(t.stride(0) >= std::max<int64_t>(1, t.size(1)), "gemm_bf16_check: `", name, "` has row stride ",
              t.stride(0), " below its width ", t.size(1));
}

// C ← alpha · op(A) op(B) + beta · C in place (A, B bf16 2-D, C fp32 2-D; rows may be padded:
// the row stride is the leading dimension). Returns C.
torch::Tensor gemm_bf16_check(const torch::Tensor& A, const torch::Tensor& B, bool ta, bool tb, double alpha,
                              double beta, torch::Tensor C) {
  check_matrix(A, "A", torch::kBFloat16);
  check_matrix(B, "B", torch::kBFloat16);
  check_matrix(C, "C", torch::kFloat);
  const int64_t m = ta ? A.size(1) : A.size(0), k = ta ? A.size(0) : A.size(1);
  const int64_t kb = tb ? B.size(1) : B.size(0), n = tb ? B.size(0) : B.size(1);
  TORCH_CHECK(kb == k, "gemm_bf16_check: op(A) is ", m, "×", k, " but op(B) is ", kb, "×", n);
  TORCH_CHECK(C.size(0) == m && C.size(1) == n, "gemm_bf16_check: `C` must be ", m, "×", n, ", got ", C.size(0), "×",
              C.size(1));
  Workspace ws;
  gemm_bf16(ta, tb, m, n, k, float(alpha), A.data_ptr<at::BFloat16>(), A.stride(0), B.data_ptr<at::BFloat16>(),
            B.stride(0), float(beta), C.data_ptr<float>(), C.stride(0), ws);
  fastweights::cpu::gemm_bf16_release();
  return C;
}

// fp32 → bf16 by fastweights::cpu::to_bf16 (any shape; contiguous copy in, contiguous out).
torch::Tensor to_bf16_check(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "to_bf16_check: `x` must be float32, got ", x.scalar_type());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty(xc.sizes(), xc.options().dtype(torch::kBFloat16));
  fastweights::cpu::to_bf16(xc.data_ptr<float>(), out.data_ptr<at::BFloat16>(), xc.numel());
  return out;
}

// e^x of float64 exponents, rounded to float32, by chunk_rows.h's exp_of (any shape).
torch::Tensor exp_check(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kDouble, "exp_check: `x` must be float64, got ", x.scalar_type());
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty(xc.sizes(), xc.options().dtype(torch::kFloat));
  fastweights::cpu::chunk::exp_of(xc.data_ptr<double>(), out.data_ptr<float>(), xc.numel());
  return out;
}

double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// GFLOP/s (2·m·n·k per call) of gemm_bf16 and of the fp32 product on the same shape and
// transposes, one thread, best of `rounds` rounds of `reps` calls each, the two kernels
// interleaved round by round; the packing is inside the bf16 timing. Returns
// {bf16, fp32, isa level the calls ran at}.
std::vector<double> gemm_bf16_bench(int64_t m, int64_t n, int64_t k, int64_t reps, bool ta, bool tb,
                                    int64_t rounds) {
  TORCH_CHECK(m > 0 && n > 0 && k > 0, "gemm_bf16_bench: m, n, k must be positive, got ", m, ", ", n, ", ", k);
  TORCH_CHECK(reps > 0 && rounds > 0, "gemm_bf16_bench: reps and rounds must be positive, got ", reps, ", ", rounds);
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  std::vector<float> af(m * k), bfp(k * n), c(m * n, 0.f);
  std::vector<at::BFloat16> ah(m * k), bh(k * n);
  uint32_t state = 12345u;
  auto next = [&state]() {
    state = state * 1664525u + 1013904223u;
    return float(int32_t(state >> 8) - (1 << 23)) / float(1 << 23);
  };
  for (auto& x : af) x = next();
  for (auto& x : bfp) x = next();
  fastweights::cpu::to_bf16(af.data(), ah.data(), m * k);
  fastweights::cpu::to_bf16(bfp.data(), bh.data(), k * n);
  for (int64_t i = 0; i < m * k; ++i) af[i] = float(ah[i]);
  for (int64_t i = 0; i < k * n; ++i) bfp[i] = float(bh[i]);
  Workspace ws;
  const fastweights::cpu::OneThreadBlas one_core;
  auto run_bf16 = [&]() {
    gemm_bf16(ta, tb, m, n, k, 1.f, ah.data(), lda, bh.data(), ldb, 0.f, c.data(), n, ws);
  };
  auto run_sgemm = [&]() { fastweights::cpu::mm<float>(ta, tb, m, n, k, 1.f, af.data(), lda, bfp.data(), ldb, 0.f, c.data(), n); };
  run_bf16();
  run_sgemm();
  double best_bf16 = 1e30, best_sgemm = 1e30;
  for (int64_t r = 0; r < rounds; ++r) {
    double t0 = thread_seconds();
    for (int64_t i = 0; i < reps; ++i) run_bf16();
    best_bf16 = std::min(best_bf16, thread_seconds() - t0);
    t0 = thread_seconds();
    for (int64_t i = 0; i < reps; ++i) run_sgemm();
    best_sgemm = std::min(best_sgemm, thread_seconds() - t0);
  }
  fastweights::cpu::gemm_bf16_release();
  const double flops = 2.0 * double(m) * double(n) * double(k) * double(reps);
  return {flops / best_bf16 * 1e-9, flops / best_sgemm * 1e-9, double(fastweights::cpu::isa())};
}

}  // namespace

// Called from the extension's module definition (chunk_delta.cpp).
void register_gemm_bf16(pybind11::module& m) {
  m.def("gemm_bf16_check", &gemm_bf16_check, "C ← alpha·op(A)op(B) + beta·C by gemm_bf16.h (bf16 A, B; fp32 C)",
        pybind11::arg("A"), pybind11::arg("B"), pybind11::arg("ta"), pybind11::arg("tb"), pybind11::arg("alpha"),
        pybind11::arg("beta"), pybind11::arg("C"));
  m.def("to_bf16_check", &to_bf16_check, "fp32 → bf16 by gemm_bf16.h's to_bf16", pybind11::arg("x"));
  m.def("exp_check", &exp_check, "e^x of float64 x, rounded to float32, by chunk_rows.h's exp_of", pybind11::arg("x"));
  m.def("gemm_bf16_bench", &gemm_bf16_bench, "GFLOP/s of gemm_bf16 and of the fp32 product on one shape, one thread, and the ISA level",
        pybind11::arg("m"), pybind11::arg("n"), pybind11::arg("k"), pybind11::arg("reps"),
        pybind11::arg("ta") = false, pybind11::arg("tb") = false, pybind11::arg("rounds") = 5);
  m.attr("has_fast_bf16") = fastweights::cpu::kHasFastBf16;
}
