// What the KDA and linear-attention chunk kernels add to chunk_common.h: a bump allocator over a
// task's scratch block, the gather / scatter of one head's chunk rows, and e^x of float64
// exponents (exp_of: KDA's fp32 and bf16-products forwards).
#pragma once

#include "chunk_common.h"

#include <type_traits>

namespace fastweights {
namespace cpu {
namespace chunk {

using ::fastweights::cpu::mm;
using ::fastweights::cpu::round16;

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

// Rows t0 .. t0 + C − 1 of one head's strided [T, width] rows into dense dst [C, ld]; rows at
// or past `length` are zeros (a no-op token for every rule here). E → D: a copy, or bf16 rows
// widened to fp32 as they are copied (chunk_common.h's copy_row), so an fp32 kernel reads plain
// bf16 inputs with no separate pass converting them first, on exactly the values that pass gives.
template <typename E, typename D>
inline void gather_rows(const E* src, int64_t stride, int64_t t0, int64_t length, int64_t C, int64_t width, D* dst,
                        int64_t ld) {
  for (int64_t i = 0; i < C; ++i) {
    if (t0 + i < length) copy_row(src + (t0 + i) * stride, dst + i * ld, width);
    else std::fill(dst + i * ld, dst + i * ld + width, D(0));
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

#if defined(__AVX512F__)
// e^x for 16 floats from float64 exponents x (x ≤ 88): n = round(x / ln 2) and r = x − n ln 2 are
// formed in float64, so the result carries no error from rounding a large x to float (e^{55}
// from a float exponent would be off by ~55 ulp of float, in relative terms 3e-6); then
// Cephes' degree-6 polynomial for e^r on |r| ≤ ln2/2 in float and the exact scaling by 2^n.
// e^x for x < −87.3 (below the smallest normal float) is returned as 0. About 1 ulp.
inline __m256 narrow(__m512d x) { return _mm512_cvtpd_ps(x); }
inline __m512 join(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

// 2^n e^r from the reduced argument r (|r| ≤ ln2/2) and n, as floats; 0 where x < −87.3.
inline __m512 exp16_reduced(__m512 r, __m512 n, __m512 x) {
  const __m512 p = exp_poly(r);  // vec.h
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

inline __m512 exp_lanes(const double* x) {
  const __m512d log2e = _mm512_set1_pd(1.4426950408889634), ln2 = _mm512_set1_pd(0.6931471805599453);
  const __m512d x0 = _mm512_loadu_pd(x), x1 = _mm512_loadu_pd(x + 8);
  const __m512d n0 = _mm512_roundscale_pd(_mm512_mul_pd(x0, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512d n1 = _mm512_roundscale_pd(_mm512_mul_pd(x1, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = join(narrow(_mm512_fnmadd_pd(n0, ln2, x0)), narrow(_mm512_fnmadd_pd(n1, ln2, x1)));
  return exp16_reduced(r, join(narrow(n0), narrow(n1)), join(narrow(x0), narrow(x1)));
}

// e^x for 16 float exponents (the same polynomial; r = x − n ln 2 with ln 2 in two parts, Cody and
// Waite, so r is exact to a float's rounding): a few ulp for |x| ≤ 60, where the exponent's own
// rounding (an ulp of x, relative 2^−24 |x|) is the larger error. For a caller that rounds the
// result to bf16 next (the bf16-products forward), where that error is far below bf16's.
inline __m512 exp16f(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  return exp16_reduced(r, n, x);
}
#elif defined(__AVX2__) && defined(__FMA__)
// The AVX-512 exp_lanes's arithmetic eight at a time. AVX2 has no scalef: p · 2^n is (p · 2^{min(n, 127)}) ·
// 2^{min(max(n − 127, 0), 127)}, both powers built in the exponent field, so n = 128 (x up to
// float's largest e^x) stays finite and larger n overflow to +Inf, exactly as scalef rounds them.
// Same reduction, same polynomial, the same results as the AVX-512 path (x < −87.3 to 0).
inline __m256 exp_lanes(const double* x) {
  const __m256d log2e = _mm256_set1_pd(1.4426950408889634), ln2 = _mm256_set1_pd(0.6931471805599453);
  const __m256d x0 = _mm256_loadu_pd(x), x1 = _mm256_loadu_pd(x + 4);
  const __m256d n0 = _mm256_round_pd(_mm256_mul_pd(x0, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256d n1 = _mm256_round_pd(_mm256_mul_pd(x1, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  auto join = [](__m256d lo, __m256d hi) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(lo)), _mm256_cvtpd_ps(hi), 1);
  };
  const __m256 r = join(_mm256_fnmadd_pd(n0, ln2, x0), _mm256_fnmadd_pd(n1, ln2, x1));
  const __m256 n = join(n0, n1), xf = join(x0, x1);
  const __m256 p = exp_poly(r);  // vec.h
  // x ≥ −87.3 gives n ≥ −126, a normal power; below, the mask zeroes the lane
  auto pow2 = [](__m256 k) {  // 2^k for integral k in [−126, 127]
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  };
  const __m256 top = _mm256_set1_ps(127.f);
  const __m256 over = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(n, top), _mm256_setzero_ps()), top);
  const __m256 live = _mm256_cmp_ps(xf, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  return _mm256_and_ps(live, _mm256_mul_ps(_mm256_mul_ps(p, pow2(_mm256_min_ps(n, top))), pow2(over)));
}
#endif

// out[i] = e^{x[i]} for float64 exponents x, rounded to T once, at the end: exp_lanes (16 or 8
// lanes) for fp32 above the portable level, the C library's exp elsewhere.
template <typename T>
inline void exp_of(const double* x, T* out, int64_t n) {
  int64_t i = 0;
#if defined(FASTWEIGHTS_VEC)
  if constexpr (std::is_same_v<T, float>) {
    if (isa() > kPortable)
      for (; i + Vec::kLanes <= n; i += Vec::kLanes) Vec::store(out + i, exp_lanes(x + i));
  }
#endif
  for (; i < n; ++i) out[i] = T(std::exp(x[i]));
}

}  // namespace chunk
}  // namespace cpu
}  // namespace fastweights
