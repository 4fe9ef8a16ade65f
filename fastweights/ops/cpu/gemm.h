// fp32 / fp64 products for the chunk kernels: row-major C[m×n] = alpha · op(A) op(B) + beta · C,
// op(X) = Xᵀ when its flag is set, one thread (the kernels parallelise over heads instead).
//
// Above the portable level (isa.h) each product is one call of MKL's sgemm_/dgemm_ (exported by
// x86 builds of libtorch_cpu), which reaches the big-matmul rate on these tiles. At the portable
// level — and in builds without MKL (ARM, macOS) — a register-blocked loop runs instead (below),
// which the compiler vectorises for whatever CPU it targets. beta == 0 never reads C (as in BLAS).
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

// The portable product (see the top of this file). op(B) is copied once into rows padded to whole
// strips of NR columns (a transposed B in TT × TT blocks, so neither side walks a whole column)
// and op(A) into panels of MR rows, p-major; then each MR × NR tile of the product is summed in
// local accumulators the compiler keeps in vector registers (MR · NR / lanes of them: 12 with AVX2,
// 24 of NEON's 32) and only then scaled and added to beta · C, as BLAS does: summing the products
// straight into a large C (the state update h ← h + K̄ᵀ U') would round at C's magnitude at every
// step. Each entry's sum runs over p in order, so a result does not depend on the tile it is in.
template <typename T>
void blocked(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
             int64_t ldb, T beta, T* c, int64_t ldc) {
  constexpr int64_t MR = 6, NR = 64 / int64_t(sizeof(T)), TT = 8;  // NR: one 64-byte line of a row
  const int64_t np = (n + NR - 1) / NR * NR, mp = (m + MR - 1) / MR * MR;
  thread_local std::vector<T> scratch;  // packed op(B) [k, np], then op(A)'s panels; reused call to call
  scratch.resize(size_t(k * (np + mp)));
  T* bp = scratch.data();
  T* ap = bp + k * np;
  if (tb) {
    for (int64_t j0 = 0; j0 < n; j0 += TT)
      for (int64_t p0 = 0; p0 < k; p0 += TT) {
        const int64_t jn = std::min(TT, n - j0), pn = std::min(TT, k - p0);
        for (int64_t p = 0; p < pn; ++p)
          for (int64_t j = 0; j < jn; ++j) bp[(p0 + p) * np + j0 + j] = b[(j0 + j) * ldb + p0 + p];
      }
  } else {
    for (int64_t p = 0; p < k; ++p) std::copy(b + p * ldb, b + p * ldb + n, bp + p * np);
  }
  for (int64_t p = 0; p < k; ++p) std::fill(bp + p * np + n, bp + (p + 1) * np, T(0));
  for (int64_t i0 = 0; i0 < mp; i0 += MR)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t r = 0; r < MR; ++r) {
        const int64_t i = i0 + r;
        ap[i0 * k + p * MR + r] = i < m ? (ta ? a[p * lda + i] : a[i * lda + p]) : T(0);
      }
  for (int64_t i0 = 0; i0 < mp; i0 += MR) {
    const T* panel = ap + i0 * k;
    const int64_t rows = std::min(MR, m - i0);
    for (int64_t j0 = 0; j0 < np; j0 += NR) {
      T acc[MR][NR] = {};
      for (int64_t p = 0; p < k; ++p) {
        const T* ar = panel + p * MR;
        const T* br = bp + p * np + j0;
        for (int64_t r = 0; r < MR; ++r)
#pragma omp simd
          for (int64_t j = 0; j < NR; ++j) acc[r][j] += ar[r] * br[j];
      }
      const int64_t cols = std::min(NR, n - j0);
      for (int64_t r = 0; r < rows; ++r) {
        T* ci = c + (i0 + r) * ldc + j0;
        if (beta == T(0))
          for (int64_t j = 0; j < cols; ++j) ci[j] = alpha * acc[r][j];
        else
          for (int64_t j = 0; j < cols; ++j) ci[j] = alpha * acc[r][j] + beta * ci[j];
      }
    }
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
