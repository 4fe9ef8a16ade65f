// A bf16 GEMM for small tiles: bf16 operands, fp32 accumulation, fp32 result, one thread.
//
//   gemm_bf16(ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, ws)
//     C[m×n] = alpha · op(A) op(B) + beta · C, row major, op(X) = Xᵀ when its flag is set
//     (the semantics of `mm<T>` in gemm.h). op(A) is m×k, op(B) is k×n; A is stored
//     m×k (ta false) or k×m (ta true) with row stride lda, B likewise k×n or n×k with ldb.
//     beta == 0 does not read C (as in BLAS: C may hold NaN).
//   pack_b(tb, k, n, B, ldb, dst) / pack_b(k, n, B_fp32, ldb, dst): op(B) packed once into the
//     VNNI-2 layout every bf16 path reads (below), from bf16 or rounded from fp32 on the way;
//   gemm_bf16_packed(ta, m, n, k, alpha, A, lda, packed_B, beta, C, ldc, ws): the product with
//     a B packed earlier, so an operand used by several products is packed once (the chunk
//     forward packs K, h and U' once per chunk and uses each twice).
//   gemm_bf16_release(): after a run of calls (a head), gives back the AMX tile state.
//   to_bf16(src, dst, n): fp32 → bf16, round to nearest even, bit for bit torch's
//     `tensor.to(torch.bfloat16)` (denormals kept, NaN → 0xFFFF).
//
// Three implementations, picked per call by the process's ISA level (isa.h):
//
// AMX (kAmx): oneDNN's brgemm micro-kernel through torch's `at::native::cpublas::brgemm`
// (the one PyTorch's CPU flash attention uses): A row major, B in VNNI-2 layout (pairs of
// k rows interleaved per column, packed here with the same packer as below), fp32 C.
// oneDNN runs the same call with AVX512-BF16 or AVX2 code where the CPU has no AMX, which is
// how the path is tested on such CPUs; it is chosen only where /proc/cpuinfo says `amx_bf16`.
//
// AVX512-BF16 (kAvx512Bf16, where the compiler targets it: `-march=native` on Zen 4/5 or Cooper
// Lake and later): both operands are packed into "VNNI" pairs, the layout `vdpbf16ps`
// (`_mm512_dpbf16_ps`) reads: word p of a packed row holds the bf16 pair (X[2p], X[2p+1]) of
// the k dimension (a zero pads an odd k), stored pair-major, [⌈k/2⌉, round16(rows)] 32-bit
// words. A register-blocked micro-kernel then keeps an MR × 16·NV tile of C in zmm registers,
// and for each k-pair broadcasts one A word per row and multiplies it into NV B vectors: one
// instruction does 16 lanes × 2 products, twice the fp32 FMA's work.
//
// Otherwise (kAvx2, kPortable) the operands are widened to fp32 in the workspace and gemm.h's
// `mm<float>` runs (MKL's sgemm_, or the portable loop): the same results, at the fp32 rate.
//
// Everything lives in a caller-owned Workspace (64-byte aligned, grown only when a call needs
// more), so a call in a loop allocates nothing.
//
// Numerics: a bf16 × bf16 product is exact in fp32, so every path gives the fp32 matmul of the
// bf16 values up to the order of the fp32 additions. `vdpbf16ps` treats bf16 denormal inputs
// as zero and flushes denormal outputs (values below 1.2e-38); nothing else differs.
// `kHasFastBf16` says whether this build has the vdpbf16ps kernel.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include "gemm.h"
#include "isa.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace fastweights {
namespace cpu {

constexpr bool kHasFastBf16 = kBuildHasAvx512Bf16;

// The AMX path needs the AVX-512 packers below as well as torch's brgemm.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(CPUBLAS_BRGEMM_BF16BF16F32) && \
    (defined(__x86_64__) || defined(_M_X64))
#define FASTWEIGHTS_BRGEMM 1
#endif

// Caller-owned scratch, 64-byte aligned; grows (never shrinks) to the largest request.
struct Workspace {
  Workspace() = default;
  ~Workspace() { std::free(data_); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  Workspace(Workspace&& o) noexcept : data_(o.data_), bytes_(o.bytes_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
  }

  // At least `bytes` bytes, 64-byte aligned; the old contents are not kept when it grows.
  void* get(size_t bytes) {
    if (bytes > bytes_) {
      const size_t want = (std::max(bytes, bytes_ + bytes_ / 2) + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, want);
      TORCH_CHECK(p != nullptr, "gemm_bf16: out of memory for ", want, " bytes of workspace");
      std::free(data_);
      data_ = p;
      bytes_ = want;
    }
    return data_;
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

namespace bf16_detail {

inline uint16_t to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (x != x) return 0xFFFF;  // NaN, as torch's vectorised conversion writes it
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

}  // namespace bf16_detail

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace bf16_detail {
// 16 floats → 16 bf16 bit patterns, round to nearest even, NaN → 0xFFFF (torch's rounding).
// The same, each bit pattern left in the low half of its 32-bit lane (the high half zero).
inline __m512i round_to_bf16_lanes(__m512 x) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0xFFFF);
  const __m512i u = _mm512_castps_si512(x);
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
  r = _mm512_srli_epi32(r, 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), nan, r);
}
inline __m256i round_to_bf16(__m512 x) { return _mm512_cvtepi32_epi16(round_to_bf16_lanes(x)); }

// The rounding of a product operand: on a path with AVX512-BF16 (and AMX), the CPU's own
// round-to-nearest-even (vcvtneps2bf16, one instruction instead of round_to_bf16's seven). It
// differs from torch's rounding only where the products cannot tell: it reads a denormal as zero,
// as the bf16 products (vdpbf16ps, AMX tiles) read a bf16 denormal, and keeps a NaN's bits (a NaN
// still). Outputs keep round_to_bf16 (to_bf16, to_bf16_scaled_stream). Else round_to_bf16.
inline __m256i round_operand(__m512 x) {
#if defined(__AVX512BF16__)
  if (isa() >= kAvx512Bf16) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
  return round_to_bf16(x);
}
// The same, each bit pattern in the low half of its 32-bit lane (as round_to_bf16_lanes).
inline __m512i round_operand_lanes(__m512 x) {
#if defined(__AVX512BF16__)
  if (isa() >= kAvx512Bf16) return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
#endif
  return round_to_bf16_lanes(x);
}
inline __mmask16 live16(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
}  // namespace bf16_detail
#elif defined(__AVX2__)
namespace bf16_detail {
// 8 floats → 8 bf16 bit patterns: round_to_bf16's steps on 8 lanes (AVX2 has no 32 → 16 bit
// narrowing, so the two halves are packed: every pattern fits 16 bits unsigned, no saturation).
inline __m128i round_to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
  r = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
}  // namespace bf16_detail
#endif

// n floats → n bf16, round to nearest even (bit for bit torch's `.to(torch.bfloat16)`).
inline void to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable) {
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bf16_detail::round_to_bf16(_mm512_loadu_ps(src + i)));
    if (i < n) {
      const __mmask16 live = bf16_detail::live16(n - i);
      _mm256_mask_storeu_epi16(out + i, live, bf16_detail::round_to_bf16(_mm512_maskz_loadu_ps(live, src + i)));
      i = n;
    }
  }
#elif defined(__AVX2__)
  if (isa() > kPortable)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bf16_detail::round_to_bf16_8(_mm256_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) out[i] = bf16_detail::to_bf16_bits(src[i]);
}

// dst = bf16(src · factor) for n fp32 entries (the product rounded once, as to_bf16 rounds;
// Operand: as a product operand is, bf16_detail::round_operand).
template <bool Operand = false>
inline void to_bf16_scaled(const float* src, float factor, at::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable) {
    const auto round = [](__m512 x) { return Operand ? bf16_detail::round_operand(x) : bf16_detail::round_to_bf16(x); };
    const __m512 f = _mm512_set1_ps(factor);
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), round(_mm512_mul_ps(_mm512_loadu_ps(src + i), f)));
    if (i < n) {
      const __mmask16 live = bf16_detail::live16(n - i);
      _mm256_mask_storeu_epi16(out + i, live, round(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, src + i), f)));
      i = n;
    }
  }
#elif defined(__AVX2__)
  if (isa() > kPortable) {  // torch's rounding (no bf16 unit on an AVX2 build, so an operand rounds alike)
    const __m256 f = _mm256_set1_ps(factor);
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                       bf16_detail::round_to_bf16_8(_mm256_mul_ps(_mm256_loadu_ps(src + i), f)));
  }
#endif
  for (; i < n; ++i) out[i] = bf16_detail::to_bf16_bits(src[i] * factor);
}

// dst = bf16(src ⊙ w) for n fp32 entries: each product rounded once as a product operand (a row
// of T diag(w); bf16_detail::round_operand).
inline void to_bf16_times(const float* src, const float* w, at::BFloat16* dst, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable) {
    for (; i < n; i += 16) {
      const __mmask16 live = bf16_detail::live16(n - i);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, src + i), _mm512_maskz_loadu_ps(live, w + i));
      _mm256_mask_storeu_epi16(out + i, live, bf16_detail::round_operand(x));
    }
  }
#endif
  for (; i < n; ++i) out[i] = bf16_detail::to_bf16_bits(src[i] * w[i]);
}

// to_bf16_scaled into a row of an output tensor that nothing reads soon: where the row starts
// on a cache line and fills whole lines, non-temporal stores write it without first reading the
// lines in (the caller ends its run of such stores with store_fence()).
inline void to_bf16_scaled_stream(const float* src, float factor, at::BFloat16* dst, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable && n % 32 == 0 && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    const __m512 f = _mm512_set1_ps(factor);
    for (int64_t i = 0; i < n; i += 32) {
      const __m256i lo = bf16_detail::round_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + i), f));
      const __m256i hi = bf16_detail::round_to_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + i + 16), f));
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
    }
    return;
  }
#endif
  to_bf16_scaled(src, factor, dst, n);
}

// Orders the non-temporal stores before whatever follows (after a run of to_bf16_scaled_stream).
inline void store_fence() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_sfence();
#endif
}

// dst = bf16(float(src) · factor) for n entries (the product rounded once, as a product operand:
// bf16_detail::round_operand).
inline void scale_to_bf16(const at::BFloat16* src, float factor, at::BFloat16* dst, int64_t n) {
  const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 f = _mm512_set1_ps(factor);
  for (; i < n && isa() > kPortable; i += 16) {
    const __mmask16 live = bf16_detail::live16(n - i);
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, in + i)), 16);
    const __m512 x = _mm512_mul_ps(_mm512_castsi512_ps(wide), f);
    _mm256_mask_storeu_epi16(out + i, live, bf16_detail::round_operand(x));
  }
#endif
  for (; i < n; ++i) out[i] = bf16_detail::to_bf16_bits(bf16_detail::bf16_to_float(in[i]) * factor);
}

// Words of a packed B operand (pack_b): ⌈k/2⌉ rows of round16(n) 32-bit words.
inline int64_t packed_b_words(int64_t k, int64_t n) { return (k + 1) / 2 * round16(n); }

// Bytes of workspace one gemm_bf16_packed call of this shape needs (the most any path takes;
// the packed B is the caller's).
inline size_t gemm_bf16_workspace_bytes(int64_t m, int64_t n, int64_t k) {
  const int64_t kp = (k + 1) / 2;
  const int64_t vnni = kp * round16(m);                                               // vdpbf16ps: A packed (words)
  const int64_t amx = kp * round16(m) + m * round16(kp) + round16(m * n);             // A (two passes), fp32 C tile
  const int64_t wide = round16(m * k) + round16(k * n);                               // both widened (floats)
  return size_t(std::max({vnni, amx, wide})) * 4 + 64;
}

namespace bf16_detail {

// C = beta · C (beta == 0: zeros, C not read): the whole product when k == 0 or alpha == 0.
inline void scale_c(int64_t m, int64_t n, float beta, float* C, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i) {
    float* c = C + i * ldc;
    if (beta == 0.f) std::fill(c, c + n, 0.f);
    else
      for (int64_t j = 0; j < n; ++j) c[j] *= beta;
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)

constexpr int kMR = 8;   // rows of C per micro-tile
constexpr int kNV = 2;   // 16-column vectors of C per micro-tile
constexpr int kNR = 16 * kNV;

inline __mmask32 mask32(int64_t live) { return live >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << live) - 1u); }

// Rows stored with the pairs along them (X[r, 2p], X[r, 2p + 1] adjacent): dst[p, r] is the
// 32-bit word at X + r·ld + 2p, i.e. a transpose of [rows, ⌈cnt/2⌉] words, done in 16×16
// blocks; an odd cnt gets a zero high half, rows and words past the ends read as zero.
// dst: [⌈cnt/2⌉, dstride] words, dstride ≥ round16(rows).
inline void pack_pairs_along_rows(const uint16_t* X, int64_t ld, int64_t rows, int64_t cnt, uint32_t* dst,
                                  int64_t dstride) {
  const int64_t kp = (cnt + 1) / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int64_t nr = std::min<int64_t>(16, rows - r0);
    for (int64_t p0 = 0; p0 < kp; p0 += 16) {
      const __mmask32 live = mask32(cnt - 2 * p0);
      __m512i r[16], t[16];
      for (int i = 0; i < 16; ++i)
        r[i] = i < nr ? _mm512_maskz_loadu_epi16(live, X + (r0 + i) * ld + 2 * p0) : _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      // r[4g + q], 128-bit lane L, holds word 4L + q of rows 4g..4g+3: a 4×4 transpose of lanes
      const int64_t np = std::min<int64_t>(16, kp - p0);
      for (int q = 0; q < 4; ++q) {
        const __m512i y0 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x44), y1 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xEE);
        const __m512i y2 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x44),
                      y3 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xEE);
        const __m512i out[4] = {_mm512_shuffle_i32x4(y0, y2, 0x88), _mm512_shuffle_i32x4(y0, y2, 0xDD),
                                _mm512_shuffle_i32x4(y1, y3, 0x88), _mm512_shuffle_i32x4(y1, y3, 0xDD)};
        for (int L = 0; L < 4; ++L) {
          const int64_t w = 4 * L + q;
          if (w < np) _mm512_storeu_si512(dst + (p0 + w) * dstride + r0, out[L]);
        }
      }
    }
  }
}

// Rows along k (X[2p, j], X[2p + 1, j] one row apart): dst[p, j] = the pair of rows 2p and
// 2p + 1 at column j; a missing row 2p + 1 (odd cnt) and columns past `width` read as zero.
// dst: [⌈cnt/2⌉, dstride] words, dstride ≥ round16(width).
inline void pack_pairs_across_rows(const uint16_t* X, int64_t ld, int64_t cnt, int64_t width, uint32_t* dst,
                                   int64_t dstride) {
  const int64_t kp = (cnt + 1) / 2;
  for (int64_t p = 0; p < kp; ++p) {
    const uint16_t* lo = X + 2 * p * ld;
    const uint16_t* hi = lo + ld;
    const bool has_hi = 2 * p + 1 < cnt;
    uint32_t* d = dst + p * dstride;
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 live = width - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (width - j)) - 1);
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, lo + j));
      const __m512i b = has_hi ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, hi + j)) : _mm512_setzero_si512();
      _mm512_storeu_si512(d + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// C[MR × (16·NV, the last vector masked by `last`)] = alpha · Σ_p a[p, 0..MR) ⊗ b[p, ..] + beta · C.
// a: packed A at the tile's first row (word stride sa per pair); b: packed B at its first column.
template <int MR, int NV>
void micro_kernel(int64_t kp, const uint32_t* __restrict a, int64_t sa, const uint32_t* __restrict b, int64_t sb,
                  float* __restrict C, int64_t ldc, float alpha, float beta, __mmask16 last) {
  __m512 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
#pragma GCC unroll 2
  for (int64_t p = 0; p < kp; ++p) {
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_load_si512(b + p * sb + 16 * v);
    const uint32_t* ap = a + p * sa;
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(int(ap[i]));
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, bv[v]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i) {
    float* c = C + i * ldc;
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mk = v == NV - 1 ? last : __mmask16(0xFFFF);
      __m512 r = _mm512_mul_ps(va, acc[i][v]);
      if (beta != 0.f) r = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(mk, c + 16 * v), r);
      _mm512_mask_storeu_ps(c + 16 * v, mk, r);
    }
  }
}

using MicroKernel = void (*)(int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, float*, int64_t, float,
                             float, __mmask16);

template <int NV, size_t... I>
constexpr std::array<MicroKernel, sizeof...(I)> kernel_row(std::index_sequence<I...>) {
  return {&micro_kernel<int(I) + 1, NV>...};
}
template <size_t... V>
constexpr std::array<std::array<MicroKernel, kMR>, sizeof...(V)> kernel_table(std::index_sequence<V...>) {
  return {kernel_row<int(V) + 1>(std::make_index_sequence<kMR>())...};
}
// kKernels[nv − 1][rows − 1]: every edge tile has its own fully unrolled kernel
inline constexpr auto kKernels = kernel_table(std::make_index_sequence<kNV>());

#endif  // AVX512-BF16

}  // namespace bf16_detail

// A B operand packed once (pack_b) and read by any number of gemm_bf16_packed calls: op(B), k×n,
// as VNNI-2 words, w[p·stride + j] = (op(B)[2p, j], op(B)[2p + 1, j]) (low half, high half), rows
// past k and columns past n zero. Both bf16 micro-kernels read this layout (oneDNN's brgemm as
// its VNNI B, the vdpbf16ps kernel as its packed B); the widened path unpacks it.
struct PackedB {
  const uint32_t* w;
  int64_t k, n, stride;
};

namespace bf16_detail {

// The packers without AVX-512 (and the reference the vectorised ones equal): op(B)[r, j] is
// B[r·ldb + j], or B[j·ldb + r] when tb.
inline void pack_b_scalar(bool tb, int64_t k, int64_t n, const uint16_t* B, int64_t ldb, uint32_t* dst,
                          int64_t stride) {
  for (int64_t p = 0; p < (k + 1) / 2; ++p)
    for (int64_t j = 0; j < stride; ++j) {
      uint32_t word = 0;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t r = 2 * p + h;
        if (r < k && j < n) word |= uint32_t(tb ? B[j * ldb + r] : B[r * ldb + j]) << (16 * h);
      }
      dst[p * stride + j] = word;
    }
}

}  // namespace bf16_detail

// Packs op(B) (k×n; B stored k×n, or n×k when tb) into dst (packed_b_words(k, n) words).
inline PackedB pack_b(bool tb, int64_t k, int64_t n, const at::BFloat16* B, int64_t ldb, uint32_t* dst) {
  const uint16_t* b16 = reinterpret_cast<const uint16_t*>(B);
  const int64_t stride = round16(n);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
  if (isa() > kPortable) {
    if (tb) bf16_detail::pack_pairs_along_rows(b16, ldb, n, k, dst, stride);
    else bf16_detail::pack_pairs_across_rows(b16, ldb, k, n, dst, stride);
    return {dst, k, n, stride};
  }
#endif
  bf16_detail::pack_b_scalar(tb, k, n, b16, ldb, dst, stride);
  return {dst, k, n, stride};
}

// Packs an fp32 B (k×n, row major, row stride ldb), each entry rounded to bf16 on the way as a
// product operand (bf16_detail::round_operand, then pack_b): one pass instead of a conversion and a pack.
inline PackedB pack_b(int64_t k, int64_t n, const float* B, int64_t ldb, uint32_t* dst) {
  const int64_t kp = (k + 1) / 2, stride = round16(n);
  int64_t p = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable) {
    for (; p < k / 2; ++p) {
      const float* lo = B + 2 * p * ldb;
      const float* hi = lo + ldb;
      uint32_t* d = dst + p * stride;
      for (int64_t j = 0; j < stride; j += 16) {
        const __mmask16 live = bf16_detail::live16(n - j);
        const __m512i a = bf16_detail::round_operand_lanes(_mm512_maskz_loadu_ps(live, lo + j));
        const __m512i b = bf16_detail::round_operand_lanes(_mm512_maskz_loadu_ps(live, hi + j));
        _mm512_storeu_si512(d + j, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
      }
    }
  }
#endif
  for (; p < kp; ++p)
    for (int64_t j = 0; j < stride; ++j) {
      uint32_t word = 0;
      for (int64_t h = 0; h < 2; ++h)
        if (2 * p + h < k && j < n) word |= uint32_t(bf16_detail::to_bf16_bits(B[(2 * p + h) * ldb + j])) << (16 * h);
      dst[p * stride + j] = word;
    }
  return {dst, k, n, stride};
}

#if defined(FASTWEIGHTS_BRGEMM)
namespace bf16_detail {

// The AMX path of gemm_bf16_packed (see the top of this file). brgemm computes C (+)= A·B for A
// row major [m, k2], B in VNNI-2 words and fp32 C, k2 = k rounded up to even. A is used in place
// when it already is row major with an even k; a transposed A is packed into pairs and its words
// transposed (both vectorised); otherwise it is copied with a zero column. C is written directly
// when alpha = 1 and beta ∈ {0, 1}, else through an fp32 tile.
inline void gemm_bf16_brgemm(bool ta, int64_t m, int64_t k, float alpha, const uint16_t* a16, int64_t lda,
                             const PackedB& B, float beta, float* C, int64_t ldc, Workspace& ws) {
  const int64_t n = B.n, kp = (k + 1) / 2, k2 = 2 * kp;
  uint32_t* base = static_cast<uint32_t*>(ws.get(gemm_bf16_workspace_bytes(m, n, k)));
  const uint16_t* a_rows = a16;
  int64_t a_ld = lda;
  uint32_t* after_a = base;
  if (ta) {
    // A stored [k, m]: pairs across its rows give op(A)ᵀ's words [kp, m]; their transpose is
    // op(A) row major, rows of round16(kp) words = 2·round16(kp) bf16.
    uint32_t* pairs = base;
    uint32_t* rows = base + kp * round16(m);
    pack_pairs_across_rows(a16, lda, k, m, pairs, round16(m));
    pack_pairs_along_rows(reinterpret_cast<const uint16_t*>(pairs), 2 * round16(m), kp, 2 * m, rows, round16(kp));
    a_rows = reinterpret_cast<const uint16_t*>(rows);
    a_ld = 2 * round16(kp);
    after_a = rows + m * round16(kp);
  } else if (k2 != k) {
    uint16_t* pa = reinterpret_cast<uint16_t*>(base);
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(pa + i * k2, a16 + i * lda, sizeof(uint16_t) * k);
      pa[i * k2 + k] = 0;
    }
    a_rows = pa;
    a_ld = k2;
    after_a = base + round16(m * kp);
  }
  const bool direct = alpha == 1.f && (beta == 0.f || beta == 1.f);
  float* ct = reinterpret_cast<float*>(after_a);  // [m, n] fp32 when not direct
  at::native::cpublas::brgemm(m, n, k2, a_ld, B.stride, direct ? ldc : n, direct && beta == 1.f,
                              reinterpret_cast<const at::BFloat16*>(a_rows),
                              reinterpret_cast<const at::BFloat16*>(B.w), direct ? C : ct, true);
  if (direct) return;
  for (int64_t i = 0; i < m; ++i) {
    float* c = C + i * ldc;
    const float* t = ct + i * n;
    if (beta == 0.f)
      for (int64_t j = 0; j < n; ++j) c[j] = alpha * t[j];
    else
      for (int64_t j = 0; j < n; ++j) c[j] = alpha * t[j] + beta * c[j];
  }
}

}  // namespace bf16_detail
#endif  // FASTWEIGHTS_BRGEMM

// C[m×n] = alpha · op(A) B + beta · C with B packed by pack_b (k×n); A as in gemm_bf16.
inline void gemm_bf16_packed(bool ta, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* A,
                             int64_t lda, const PackedB& B, float beta, float* C, int64_t ldc, Workspace& ws) {
  using namespace bf16_detail;
  TORCH_CHECK(B.k == k && B.n == n, "gemm_bf16_packed: B was packed ", B.k, "×", B.n, ", the product needs ", k, "×", n);
  if (m <= 0 || n <= 0) return;
  if (k <= 0 || alpha == 0.f) {
    scale_c(m, n, beta, C, ldc);
    return;
  }
  const uint16_t* a16 = reinterpret_cast<const uint16_t*>(A);
  const int level = isa();
#if defined(FASTWEIGHTS_BRGEMM)
  if (level >= kAmx) {
    gemm_bf16_brgemm(ta, m, k, alpha, a16, lda, B, beta, C, ldc, ws);
    return;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
  if (level >= kAvx512Bf16) {
    const int64_t kp = (k + 1) / 2, sa = round16(m);
    uint32_t* pa = static_cast<uint32_t*>(ws.get(gemm_bf16_workspace_bytes(m, n, k)));
    if (ta) pack_pairs_across_rows(a16, lda, k, m, pa, sa);  // A: [k, m]
    else pack_pairs_along_rows(a16, lda, m, k, pa, sa);      // A: [m, k]
    for (int64_t j0 = 0; j0 < n; j0 += kNR) {
      const int64_t w = std::min<int64_t>(kNR, n - j0), nv = (w + 15) / 16, tail = w - 16 * (nv - 1);
      const __mmask16 last = tail == 16 ? __mmask16(0xFFFF) : __mmask16((1u << tail) - 1);
      const auto& row = kKernels[nv - 1];
      for (int64_t i0 = 0; i0 < m; i0 += kMR) {
        const int64_t rows = std::min<int64_t>(kMR, m - i0);
        row[rows - 1](kp, pa + i0, sa, B.w + j0, B.stride, C + i0 * ldc + j0, ldc, alpha, beta, last);
      }
    }
    return;
  }
#endif
  // widen A as stored and unpack B, both to fp32, and let gemm.h's fp32 product run
  const int64_t ar = ta ? k : m, ac = ta ? m : k;
  float* fa = static_cast<float*>(ws.get(gemm_bf16_workspace_bytes(m, n, k)));
  float* fb = fa + round16(m * k);
  for (int64_t i = 0; i < ar; ++i)
    for (int64_t j = 0; j < ac; ++j) fa[i * ac + j] = bf16_to_float(a16[i * lda + j]);
  for (int64_t r = 0; r < k; ++r)
    for (int64_t j = 0; j < n; ++j)
      fb[r * n + j] = bf16_to_float(uint16_t(B.w[(r / 2) * B.stride + j] >> (16 * (r % 2))));
  mm<float>(ta, false, m, n, k, alpha, fa, ac, fb, n, beta, C, ldc);
}

// C[m×n] = alpha · op(A) op(B) + beta · C (row major; see the top of this file): B packed into
// this thread's own buffer, then gemm_bf16_packed.
inline void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* A,
                      int64_t lda, const at::BFloat16* B, int64_t ldb, float beta, float* C, int64_t ldc,
                      Workspace& ws) {
  if (m <= 0 || n <= 0) return;
  thread_local Workspace packed;
  uint32_t* dst = static_cast<uint32_t*>(packed.get(sizeof(uint32_t) * size_t(std::max<int64_t>(1, packed_b_words(k, n)))));
  gemm_bf16_packed(ta, m, n, k, alpha, A, lda, pack_b(tb, k, n, B, ldb, dst), beta, C, ldc, ws);
}

// After a run of gemm_bf16 calls on one thread: on the AMX path, oneDNN's brgemm leaves the tile
// configuration loaded until told; elsewhere nothing to do.
inline void gemm_bf16_release() {
#if defined(FASTWEIGHTS_BRGEMM)
  if (isa() >= kAmx) at::native::cpublas::brgemm_release(true);
#endif
}

}  // namespace cpu
}  // namespace fastweights
