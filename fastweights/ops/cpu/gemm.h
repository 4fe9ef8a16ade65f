// fp32 / fp64 products for the chunk kernels: row-major C[m×n] = alpha · op(A) op(B) + beta · C,
// op(X) = Xᵀ when its flag is set, one thread (the kernels parallelise over heads instead).
//
// Above the portable level (isa.h) each product is one call of MKL's sgemm_/dgemm_ (exported by
// x86 builds of libtorch_cpu), which reaches the big-matmul rate on these tiles. At the portable
// level — and in builds without MKL (ARM, macOS) — a blocked loop runs instead: op(B) copied once
// into contiguous rows, then each row of the product accumulated as a[i, p] · B[p, :], an inner
// loop the compiler vectorises for whatever CPU it targets. beta == 0 never reads C (as in BLAS).
#pragma once

#include "isa.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(FASTWEIGHTS_MKL)
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
int MKL_Set_Num_Threads_Local(int);  // MKL's C entry point (the lowercase name is the Fortran one)
}
#endif

namespace fastweights {
namespace cpu {

// n rounded up to a multiple of 16 elements: keeps every scratch matrix 64-byte aligned.
inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// MKL single-threaded inside a scope (one core per head, whatever the caller's threads); a no-op
// without MKL.
struct OneThreadBlas {
#if defined(FASTWEIGHTS_MKL)
  OneThreadBlas() : previous_(MKL_Set_Num_Threads_Local(1)) {}
  ~OneThreadBlas() { MKL_Set_Num_Threads_Local(previous_); }

 private:
  int previous_;
#endif
};

namespace gemm_detail {

// The portable product (see the top of this file). Each row of op(A) op(B) is summed in its own
// accumulator and only then scaled and added to beta · C, as BLAS does: summing the products
// straight into a large C (the state update h ← h + K̄ᵀ U') would round at C's magnitude at every
// step.
template <typename T>
void blocked(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  thread_local std::vector<T> scratch;  // op(B) as [k, n], then one accumulator row; reused call to call
  scratch.resize(size_t(k * n + n));
  T* bp = scratch.data();
  T* acc = bp + k * n;
  for (int64_t p = 0; p < k; ++p)
    for (int64_t j = 0; j < n; ++j) bp[p * n + j] = tb ? b[j * ldb + p] : b[p * ldb + j];
  for (int64_t i = 0; i < m; ++i) {
    std::fill(acc, acc + n, T(0));
    for (int64_t p = 0; p < k; ++p) {
      const T aip = ta ? a[p * lda + i] : a[i * lda + p];
      const T* bpp = bp + p * n;
      for (int64_t j = 0; j < n; ++j) acc[j] += aip * bpp[j];
    }
    T* ci = c + i * ldc;
    if (beta == T(0))
      for (int64_t j = 0; j < n; ++j) ci[j] = alpha * acc[j];
    else
      for (int64_t j = 0; j < n; ++j) ci[j] = alpha * acc[j] + beta * ci[j];
  }
}

#if defined(FASTWEIGHTS_MKL)
inline void blas(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                 const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                 const int* ldc) {
  sgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void blas(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
                 const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
                 const int* ldc) {
  dgemm_(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#endif

}  // namespace gemm_detail

// Row-major C[m×n] = alpha · op(A) op(B) + beta · C (see the top of this file).
template <typename T>
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m <= 0 || n <= 0) return;
#if defined(FASTWEIGHTS_MKL)
  if (isa() > kPortable) {
    // column-major BLAS sees the transposes: Cᵀ = op(B)ᵀ op(A)ᵀ
    const char opb = tb ? 'T' : 'N', opa = ta ? 'T' : 'N';
    const int m_ = int(m), n_ = int(n), k_ = int(k), lda_ = int(lda), ldb_ = int(ldb), ldc_ = int(ldc);
    gemm_detail::blas(&opb, &opa, &n_, &m_, &k_, &alpha, b, &ldb_, a, &lda_, &beta, c, &ldc_);
    return;
  }
#endif
  gemm_detail::blocked<T>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace cpu
}  // namespace fastweights
