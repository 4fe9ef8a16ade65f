// What the bf16-products chunk forwards share (chunk_delta_bf16.cpp's for the delta rules):
// packing fp32 rows and states as bf16 B operands, the transposed key
// rows, the fp32 triangular inverse with split sums, and the checked bf16 row copy.
#pragma once

#include "chunk_common.h"

namespace fastweights {
namespace cpu {
namespace chunk {

using B16 = at::BFloat16;
using ::fastweights::cpu::gemm_bf16_packed;
using ::fastweights::cpu::pack_b;
using ::fastweights::cpu::packed_b_words;
using ::fastweights::cpu::to_bf16;
using ::fastweights::cpu::to_bf16_scaled;
using ::fastweights::cpu::to_bf16_times;

// A task's scratch laid out field by field, each rounded up to 16 floats (bf16s: the floats that
// hold `count` bf16 values); `at` is the end so far.
struct ScratchPlan {
  int64_t at = 0;
  void put(int64_t& field, int64_t floats) {
    field = at;
    at += fastweights::cpu::round16(floats);
  }
  static int64_t bf16s(int64_t count) { return fastweights::cpu::round16((count + 1) / 2); }
};

// Typed views of a task's scratch block (offsets in floats, as the forwards' Layout gives them).
struct ScratchView {
  float* base;
  B16* b16(int64_t at) const { return reinterpret_cast<B16*>(base + at); }
  uint32_t* w32(int64_t at) const { return reinterpret_cast<uint32_t*>(base + at); }
};

// dst = VNNI-2 pack (gemm_bf16.h's pack_b layout) of X + Y rounded to bf16, X and Y fp32 rows
// (C × V, leading dimensions ldx, ldy): the sum in fp32, rounded once, as to_bf16 rounds.
inline fastweights::cpu::PackedB pack_sum(int64_t C, int64_t V, const float* X, int64_t ldx, const float* Y,
                                          int64_t ldy, uint32_t* dst) {
  using namespace fastweights::cpu;
  const int64_t kp = (C + 1) / 2, stride = round16(V);
  int64_t p = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable) {
    auto z = [&](int64_t i, int64_t j, __mmask16 live) {
      const __m512 s = _mm512_add_ps(_mm512_maskz_loadu_ps(live, X + i * ldx + j), _mm512_maskz_loadu_ps(live, Y + i * ldy + j));
      return bf16_detail::round_operand_lanes(s);
    };
    for (; p < C / 2; ++p) {
      uint32_t* d = dst + p * stride;
      for (int64_t j = 0; j < stride; j += 16) {
        const __mmask16 live = bf16_detail::live16(V - j);
        _mm512_storeu_si512(d + j, _mm512_or_si512(z(2 * p, j, live), _mm512_slli_epi32(z(2 * p + 1, j, live), 16)));
      }
    }
  }
#endif
  for (; p < kp; ++p)
    for (int64_t j = 0; j < stride; ++j) {
      uint32_t word = 0;
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t i = 2 * p + h;
        if (i < C && j < V) word |= uint32_t(bf16_detail::to_bf16_bits(X[i * ldx + j] + Y[i * ldy + j])) << (16 * h);
      }
      dst[p * stride + j] = word;
    }
  return {dst, C, V, stride};
}

// How the bf16 forwards group a thread's heads. Each head keeps its own [−W h; O; h] rows beside
// the shared scratch (head_rows_floats: 2C rows of V, then its K × V state; one leading dimension
// V); as many heads as keep those rows within about 1 MiB (at most kMaxGroup) are worked on side
// by side, chunk by chunk: the heads of one token are adjacent in memory, so a group reads each
// chunk's input rows as longer runs than one head's row.
constexpr int64_t kMaxGroup = 8;
inline int64_t head_rows_floats(int64_t C, int64_t K, int64_t V) { return fastweights::cpu::round16((2 * C + K) * V); }
inline int64_t head_group(int64_t C, int64_t K, int64_t V) {
  return std::max<int64_t>(1, std::min<int64_t>(kMaxGroup, (int64_t(1) << 18) / head_rows_floats(C, K, V)));
}

// The state h [K, V] fp32 scaled by `pre` and packed as a B operand (pack_b's fp32 overload, bit
// for bit, where pre is 1), and h ← pre · h · post in place in the same pass where that is not h:
// `pre` is a decay still owed to h (the previous chunk's e^{b_C} where the forward defers it),
// `post` the decay the state update needs before it adds K̄ᵀ U' (the packed copy is of h · pre).
// pre(i) gives row i's factor (one for all rows: the gated rule's; one per row: KDA's per-channel
// decay), owed whether there is one at all.
template <typename RowFactor>
inline fastweights::cpu::PackedB pack_state_by(int64_t K, int64_t V, float* h, RowFactor pre, bool owed, float post,
                                               uint32_t* dst) {
  using namespace fastweights::cpu;
  const bool scaled = owed || post != 1.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable && K % 2 == 0 && V % 16 == 0) {
    const __m512 f2 = _mm512_set1_ps(post);
    for (int64_t p = 0; p < K / 2; ++p) {
      float* lo = h + 2 * p * V;
      float* hi = lo + V;
      uint32_t* d = dst + p * V;
      const __m512 fa = _mm512_set1_ps(owed ? pre(2 * p) : 1.f), fb = _mm512_set1_ps(owed ? pre(2 * p + 1) : 1.f);
      for (int64_t j = 0; j < V; j += 16) {
        __m512 a = _mm512_loadu_ps(lo + j), b = _mm512_loadu_ps(hi + j);
        if (owed) {
          a = _mm512_mul_ps(a, fa);
          b = _mm512_mul_ps(b, fb);
        }
        _mm512_storeu_si512(d + j, _mm512_or_si512(bf16_detail::round_operand_lanes(a),
                                                   _mm512_slli_epi32(bf16_detail::round_operand_lanes(b), 16)));
        if (scaled) {
          _mm512_storeu_ps(lo + j, _mm512_mul_ps(a, f2));
          _mm512_storeu_ps(hi + j, _mm512_mul_ps(b, f2));
        }
      }
    }
    return {dst, K, V, V};
  }
#endif
  if (owed)
    for (int64_t i = 0; i < K; ++i) {
      const float f = pre(i);
      for (int64_t j = 0; j < V; ++j) h[i * V + j] *= f;
    }
  const auto packed = pack_b(K, V, h, V, dst);
  if (post != 1.f)
    for (int64_t i = 0; i < K * V; ++i) h[i] *= post;
  return packed;
}

// pack_state_by with one factor for every row (none owed where pre is 1).
inline fastweights::cpu::PackedB pack_state(int64_t K, int64_t V, float* h, float pre, float post, uint32_t* dst) {
  return pack_state_by(K, V, h, [pre](int64_t) { return pre; }, pre != 1.f, post, dst);
}

// pack_state_by with row i's owed factor pre[i] (pre null: none owed) and no post.
inline fastweights::cpu::PackedB pack_state_rows(int64_t K, int64_t V, float* h, const float* pre, uint32_t* dst) {
  return pack_state_by(K, V, h, [pre](int64_t i) { return pre[i]; }, pre != nullptr, 1.f, dst);
}

// A forward's final state: diag(pre) h into dst (pre(i) as for pack_state_by), a plain copy where
// nothing is owed (the decay a forward defers to the next pack of h, still owed after its last chunk).
template <typename RowFactor>
inline void store_state_by(int64_t K, int64_t V, const float* h, RowFactor pre, bool owed, float* dst) {
  if (!owed) {
    std::memcpy(dst, h, sizeof(float) * K * V);
    return;
  }
  for (int64_t i = 0; i < K; ++i) {
    const float f = pre(i);
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) dst[i * V + j] = h[i * V + j] * f;
  }
}

// Row i of X [rows, n] (ld n) times f[i], in place (the forwards' per-row decays).
inline void scale_rows(int64_t rows, int64_t n, float* X, const float* f) {
  for (int64_t i = 0; i < rows; ++i) {
    const float r = f[i];
    float* row = X + i * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) row[j] *= r;
  }
}


// dst [K, ldd] = (diag(f) X)ᵀ rounded to bf16, X the C × K bf16 rows at src (ld lds), f null: no
// scaling (Xᵀ); the scaled rows are rounded once (scale_to_bf16) before they are transposed. ldd
// ≥ transposed_ld(C). tmp: C·K bf16 and ⌈C/2⌉·round16(K) words of scratch.
inline int64_t transposed_ld(int64_t C) { return 2 * fastweights::cpu::round16((C + 1) / 2); }

inline void transpose_keys(int64_t C, int64_t K, const B16* src, int64_t lds, const float* f, B16* dst, int64_t ldd,
                           B16* tmp, uint32_t* words) {
  using namespace fastweights::cpu;
  if (f != nullptr) {
    for (int64_t i = 0; i < C; ++i) scale_to_bf16(src + i * lds, f[i], tmp + i * K, K);
    src = tmp;
    lds = K;
  }
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(src);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
  if (isa() > kPortable && ldd % 2 == 0) {
    // pairs of rows (X[2p, j], X[2p + 1, j]) as words [⌈C/2⌉, K], then those words transposed:
    // row j of the result is (X[0, j], X[1, j], …) = row j of Xᵀ
    const int64_t kp = (C + 1) / 2;
    bf16_detail::pack_pairs_across_rows(s16, lds, C, K, words, round16(K));
    bf16_detail::pack_pairs_along_rows(reinterpret_cast<const uint16_t*>(words), 2 * round16(K), kp, 2 * K,
                                       reinterpret_cast<uint32_t*>(dst), ldd / 2);
    return;
  }
#endif
  uint16_t* d16 = reinterpret_cast<uint16_t*>(dst);
  for (int64_t j = 0; j < K; ++j)
    for (int64_t i = 0; i < C; ++i) d16[j * ldd + i] = s16[i * lds + j];
}

#if defined(__AVX512F__)
// unit_lower_inverse (chunk_common.h) with its sum over earlier rows split into NS interleaved
// partial sums: row r's sum Σ_{i<r} S[r, i] T_i is one chain of dependent FMAs there, r long, so
// the solve waits on the FMA latency; NS chains of r / NS run side by side (C = 16·NB, NB·NS ≤ 16
// registers of sums). The partial sums are added in a fixed order, so the result is deterministic.
template <int NB, int NS>
void unit_lower_inverse_split(int64_t C, const float* S, const float* beta, float* Tm) {
  for (int64_t r = 0; r < C; ++r) {
    __m512 acc[NS][NB];
#pragma GCC unroll 16
    for (int u = 0; u < NS; ++u)
#pragma GCC unroll 8
      for (int v = 0; v < NB; ++v) acc[u][v] = _mm512_setzero_ps();
    const float* s = S + r * C;
    const float minus_beta = -beta[r];
    int64_t i = 0;
    for (; i + NS <= r; i += NS) {
#pragma GCC unroll 4
      for (int u = 0; u < NS; ++u) {
        const __m512 a = _mm512_set1_ps(minus_beta * s[i + u]);
        const float* ti = Tm + (i + u) * C;
        const int64_t live = (i + u) / 16 + 1;
#pragma GCC unroll 8
        for (int v = 0; v < NB; ++v)
          if (v < live) acc[u][v] = _mm512_fmadd_ps(a, _mm512_loadu_ps(ti + 16 * v), acc[u][v]);
      }
    }
    for (; i < r; ++i) {
      const __m512 a = _mm512_set1_ps(minus_beta * s[i]);
      const float* ti = Tm + i * C;
      const int64_t live = i / 16 + 1;
#pragma GCC unroll 8
      for (int v = 0; v < NB; ++v)
        if (v < live) acc[0][v] = _mm512_fmadd_ps(a, _mm512_loadu_ps(ti + 16 * v), acc[0][v]);
    }
#pragma GCC unroll 8
    for (int v = 0; v < NB; ++v) {
      __m512 sum = acc[0][v];
#pragma GCC unroll 4
      for (int u = 1; u < NS; ++u) sum = _mm512_add_ps(sum, acc[u][v]);
      _mm512_storeu_ps(Tm + r * C + 16 * v, sum);
    }
    Tm[r * C + r] = 1.f;
  }
}
#endif

// Tm = (I + diag(β) S)⁻¹ for strictly lower S (chunk_common.h's unit_lower_inverse, the same
// algebra): the split-sum version above where C is 16, 32, …, 128, else that one.
inline void unit_lower_inverse_bf16fwd(int64_t C, const float* S, const float* beta, float* Tm) {
#if defined(__AVX512F__)
  if (fastweights::cpu::isa() > fastweights::cpu::kPortable && C % 16 == 0) {
    switch (C / 16) {
      case 1: return unit_lower_inverse_split<1, 4>(C, S, beta, Tm);
      case 2: return unit_lower_inverse_split<2, 4>(C, S, beta, Tm);
      case 3: return unit_lower_inverse_split<3, 4>(C, S, beta, Tm);
      case 4: return unit_lower_inverse_split<4, 4>(C, S, beta, Tm);
      case 5: return unit_lower_inverse_split<5, 2>(C, S, beta, Tm);
      case 6: return unit_lower_inverse_split<6, 2>(C, S, beta, Tm);
      case 7: return unit_lower_inverse_split<7, 2>(C, S, beta, Tm);
      case 8: return unit_lower_inverse_split<8, 2>(C, S, beta, Tm);
      default: break;
    }
  }
#endif
  unit_lower_inverse<float>(C, S, beta, Tm);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// dst[0 .. n) = src[0 .. n) (bf16), 32 entries a vector, and low = the lane-wise minimum of low
// and each entry's inverted exponent bits (~x & 0x7f80: zero only for NaN or ±Inf; the masked
// tail's missing lanes read as zero, a finite value).
inline void copy_row_checked(const B16* src, B16* dst, int64_t n, __m512i& low) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  const __m512i exponent = _mm512_set1_epi16(0x7f80);
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512i x = _mm512_loadu_si512(s + j);
    _mm512_storeu_si512(d + j, x);
    low = _mm512_min_epu16(low, _mm512_andnot_si512(x, exponent));
  }
  if (j < n) {
    const __mmask32 live = __mmask32((uint64_t(1) << (n - j)) - 1);
    const __m512i x = _mm512_maskz_loadu_epi16(live, s + j);
    _mm512_mask_storeu_epi16(d + j, live, x);
    low = _mm512_min_epu16(low, _mm512_andnot_si512(x, exponent));
  }
}
#endif

// One chunk's bf16 q, k, v rows: rows t0 .. t0 + rows − 1 of one head's strided rows (time strides
// q_t, k_t, v_t) into Qd, Kd, Vd (leading dimensions ldq, ldk, ldv), rows `rows` .. C − 1 zero (a
// no-op token), with the ops' finite check on the way: bad (nullptr: no check) gets q's, k's and v's
// NaN/Inf counts added. Above the portable level the check rides on the copy (copy_row_checked);
// the exact counts are taken only where there is something to count.
inline void gather_qkv_checked(const B16* q, int64_t q_t, const B16* k, int64_t k_t, const B16* v, int64_t v_t,
                               int64_t t0, int64_t rows, int64_t C, int64_t K, int64_t V, B16* Qd, int64_t ldq,
                               B16* Kd, int64_t ldk, B16* Vd, int64_t ldv, int64_t* bad) {
  bool any = false, copied = false;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (fastweights::cpu::isa() > fastweights::cpu::kPortable) {
    // each entry's exponent bits, inverted, into a running minimum (zero only for NaN/±Inf), while
    // the rows are in registers anyway
    __m512i low = _mm512_set1_epi16(0x7f80);
    for (int64_t i = 0; i < rows; ++i) {
      copy_row_checked(q + (t0 + i) * q_t, Qd + i * ldq, K, low);
      copy_row_checked(k + (t0 + i) * k_t, Kd + i * ldk, K, low);
      copy_row_checked(v + (t0 + i) * v_t, Vd + i * ldv, V, low);
    }
    any = _mm512_cmpeq_epi16_mask(low, _mm512_setzero_si512()) != 0;
    copied = true;
  }
#endif
  if (!copied) {
    for (int64_t i = 0; i < rows; ++i) {
      std::memcpy(Qd + i * ldq, q + (t0 + i) * q_t, sizeof(B16) * K);
      std::memcpy(Kd + i * ldk, k + (t0 + i) * k_t, sizeof(B16) * K);
      std::memcpy(Vd + i * ldv, v + (t0 + i) * v_t, sizeof(B16) * V);
    }
    // the check once every row is in (row by row in the loop above, its loads would hold back the next rows')
    for (int64_t i = 0; bad != nullptr && i < rows && !any; ++i)
      any = any_nonfinite(Qd + i * ldq, K) || any_nonfinite(Kd + i * ldk, K) || any_nonfinite(Vd + i * ldv, V);
  }
  const B16 zero(0.f);
  for (int64_t i = rows; i < C; ++i) {
    std::fill(Qd + i * ldq, Qd + i * ldq + K, zero);
    std::fill(Kd + i * ldk, Kd + i * ldk + K, zero);
    std::fill(Vd + i * ldv, Vd + i * ldv + V, zero);
  }
  if (bad != nullptr && any) {
    bad[0] += rows_nonfinite(Qd, ldq, rows, K);
    bad[1] += rows_nonfinite(Kd, ldk, rows, K);
    bad[2] += rows_nonfinite(Vd, ldv, rows, V);
  }
}

}  // namespace chunk
}  // namespace cpu
}  // namespace fastweights
