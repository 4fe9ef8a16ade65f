// Helpers shared by the chunk kernels of linear attention and KDA (chunk_linear_attn.cpp,
// chunk_kda.cpp): row-major BLAS products on scratch tiles, the per-(sequence, head) task
// loop, strided row gathers. The conventions are chunk_delta.cpp's (one task per (sequence,
// head), 64-byte-aligned scratch, single-threaded BLAS per task: bitwise batch invariance).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "gemm_bf16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
            const int*, const float*, const int*, const float*, float*, const int*);
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*, const double*,
            const int*, const double*, const int*, const double*, double*, const int*);
int MKL_Set_Num_Threads_Local(int);
}

namespace fastweights {
namespace cpu {
namespace chunk {

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

// Row-major C[m×n] = alpha · op(A) op(B) + beta · C, op(X) = Xᵀ when its flag is set
// (column-major BLAS computes Cᵀ = op(B)ᵀ op(A)ᵀ). Empty products only scale C.
template <typename T>
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
               int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const char opb = tb ? 'T' : 'N', opa = ta ? 'T' : 'N';
  const int m_ = int(m), n_ = int(n), k_ = int(k), lda_ = int(std::max<int64_t>(lda, 1)),
            ldb_ = int(std::max<int64_t>(ldb, 1)), ldc_ = int(ldc);
  blas(&opb, &opa, &n_, &m_, &k_, &alpha, b, &ldb_, a, &lda_, &beta, c, &ldc_);
}

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }  // every scratch matrix stays 64-byte aligned

// Bump allocator over one task's scratch block (sizes rounded to 16 elements).
template <typename T>
struct Carve {
  T* p;
  T* take(int64_t count) {
    T* out = p;
    p += round16(count);
    return out;
  }
};

// Runs work.head(nh, scratch) for every (sequence, head) over torch's threads; each thread owns
// one aligned scratch block of work.scratch_size() elements and calls BLAS single-threaded.
template <typename Work>
void per_head(const Work& work) {
  using T = std::remove_cv_t<decltype(Work::scale)>;
  const int64_t tasks = work.N * work.H, size = work.scratch_size();
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    const int previous = MKL_Set_Num_Threads_Local(1);
    Workspace scratch;
    T* base = static_cast<T*>(scratch.get(sizeof(T) * size_t(size)));
    for (int64_t nh = begin; nh < end; ++nh) work.head(nh, base);
    MKL_Set_Num_Threads_Local(previous);
  });
}

// The strides (n, h, t) of a head-first [N, H, T, ·] or [N, H, T] tensor, in elements.
inline void strides3(const torch::Tensor& t, int64_t* s) {
  for (int i = 0; i < 3; ++i) s[i] = t.stride(i);
}

// Rows t0 .. t0 + C − 1 of one head's strided [T, width] rows into dense dst [C, ld]; rows at
// or past `length` are zeros (a no-op token for every rule here).
template <typename T>
inline void gather_rows(const T* src, int64_t stride, int64_t t0, int64_t length, int64_t C, int64_t width, T* dst,
                        int64_t ld) {
  for (int64_t i = 0; i < C; ++i) {
    if (t0 + i < length) std::memcpy(dst + i * ld, src + (t0 + i) * stride, sizeof(T) * width);
    else std::fill(dst + i * ld, dst + i * ld + width, T(0));
  }
}

// The inverse: rows of a dense [C, ld] tile into the token-major buffer [N, NC·C, H, width] at
// (n, t0, h); the buffer has NC·C rows, so the padded tail is written too and dropped in Python.
template <typename T>
inline void scatter_rows(const T* src, int64_t ld, int64_t C, int64_t width, T* buffer, int64_t n, int64_t NCC,
                         int64_t H, int64_t hh, int64_t t0) {
  for (int64_t i = 0; i < C; ++i)
    std::memcpy(buffer + ((n * NCC + t0 + i) * H + hh) * width, src + i * ld, sizeof(T) * width);
}

}  // namespace chunk
}  // namespace cpu
}  // namespace fastweights
