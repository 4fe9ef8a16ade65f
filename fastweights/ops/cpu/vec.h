// The fp32 vector operations that the kernels' hand-written loops share between their AVX-512 and
// AVX2 forms. `Vec` is the build's widest float vector: 16 lanes where the compiler targets
// AVX-512F, 8 where it targets AVX2 and FMA (AMD Zen 2/3, Intel client cores); FASTWEIGHTS_VEC is
// defined where either exists. A loop written once on Vec is the AVX-512 form in an AVX-512 build
// and the AVX2 form in an AVX2 build; callers take it above the portable level only (isa.h).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include <cstdint>
#define FASTWEIGHTS_VEC 1

namespace fastweights {
namespace cpu {

// load_bf16(p): kLanes bf16 values (their bit patterns at p) widened to fp32, exactly (a bf16 is the
// upper half of the fp32 with the same value).
struct Vec {
#if defined(__AVX512F__)
  using R = __m512;
  static constexpr int kLanes = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static void stream(float* p, R x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
#else
  using R = __m256;
  static constexpr int kLanes = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static void stream(float* p, R x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
#endif
};

// e^r for the reduced argument |r| ≤ ln2/2: Cephes' degree-6 polynomial, about 1 ulp (the
// kernels' exponentials scale it by 2^n, chunk_rows.h).
inline Vec::R exp_poly(Vec::R r) {
  Vec::R p = Vec::set1(1.9875691500e-4f);
  p = Vec::fmadd(p, r, Vec::set1(1.3981999507e-3f));
  p = Vec::fmadd(p, r, Vec::set1(8.3334519073e-3f));
  p = Vec::fmadd(p, r, Vec::set1(4.1665795894e-2f));
  p = Vec::fmadd(p, r, Vec::set1(1.6666665459e-1f));
  p = Vec::fmadd(p, r, Vec::set1(5.0000001201e-1f));
  return Vec::fmadd(p, Vec::mul(r, r), Vec::add(r, Vec::set1(1.f)));
}

}  // namespace cpu
}  // namespace fastweights
#endif
