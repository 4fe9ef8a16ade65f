// The (gated) delta rule's chunk forward with bf16 products, on the CPU, one (sequence, head)
// per task, a thread's tasks worked on in groups chunk by chunk (inference: nothing kept for a
// backward). The products run on whatever gemm_bf16.h's ISA path is (AMX, AVX512-BF16, or
// widened to fp32); the shared pieces are chunk_common.h.
#include "chunk_common.h"

namespace {

using namespace fastweights::cpu::chunk;
using fastweights::cpu::round16;

// The forward with bf16 products (inference: nothing kept for a backward). Every product takes
// bf16 operands and accumulates in fp32 (gemm_bf16.h: AMX tiles or AVX512-BF16's dot-product
// instruction where the CPU has them); the state, the decays, the triangular solve for T and every
// sum stay fp32, and an operand is rounded to bf16 once, right before its first product. The
// inputs' own bf16 rows serve as they are: [W | U] = T diag(β)[K e^b | V] is computed as
// (T diag(β e^b)) K and (T diag(β)) V, so only the two C×C factors are rounded (not the C×(K + V)
// scaled rows), and O = diag(e^b)(Q h) + P U' scales the fp32 rows of Q h (not Q).
//
// Every call costs the product's dispatch, so products that share their B operand run as one call
// on stacked A rows (one leading dimension; the scratch keeps −W, Q and K | V in consecutive rows,
// and [−W h; O; h] likewise), each C (+)= A B with no scaling (what the AMX path writes directly):
//   [P; S]    = [Q; K] Kᵀ                (P unscaled)
//   [W | U]   = (T diag(β e^b)) K | (T diag(β)) V   (one call [W | U] where ungated)
//   [−W h; O] = [−W; Q] h                (U' = U + (−W h) is formed as it is packed)
//   [O; h]   += [P; K̄ᵀ] U'               (O scaled by e^b and h by e^{b_C} first)
// with K̄ = diag(e^{b_C − b}) K, transposed once per chunk. The attention scale is applied as O is
// rounded to the output (P is kept unscaled, so O accumulates Q h + P U' and is scaled once).
constexpr int64_t kAheadParts = 5;  // the next chunk's rows are asked for in parts, one after each product

using B16 = at::BFloat16;

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
      return bf16_detail::round_to_bf16_lanes(s);
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

// The state h [K, V] fp32 packed as a B operand (pack_b's fp32 overload, bit for bit), and, where
// `factor` is not 1, h scaled by it in place in the same pass (the decay e^{b_C} the state update
// needs before it adds K̄ᵀ U'; the packed copy is of h as it was).
inline fastweights::cpu::PackedB pack_state(int64_t K, int64_t V, float* h, float factor, uint32_t* dst) {
  using namespace fastweights::cpu;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (isa() > kPortable && K % 2 == 0 && V % 16 == 0) {
    const __m512 f = _mm512_set1_ps(factor);
    const bool scaled = factor != 1.f;
    for (int64_t p = 0; p < K / 2; ++p) {
      float* lo = h + 2 * p * V;
      float* hi = lo + V;
      uint32_t* d = dst + p * V;
      for (int64_t j = 0; j < V; j += 16) {
        const __m512 a = _mm512_loadu_ps(lo + j), b = _mm512_loadu_ps(hi + j);
        _mm512_storeu_si512(d + j, _mm512_or_si512(bf16_detail::round_to_bf16_lanes(a),
                                                   _mm512_slli_epi32(bf16_detail::round_to_bf16_lanes(b), 16)));
        if (scaled) {
          _mm512_storeu_ps(lo + j, _mm512_mul_ps(a, f));
          _mm512_storeu_ps(hi + j, _mm512_mul_ps(b, f));
        }
      }
    }
    return {dst, K, V, V};
  }
#endif
  const auto packed = pack_b(K, V, h, V, dst);
  if (factor != 1.f)
    for (int64_t i = 0; i < K * V; ++i) h[i] *= factor;
  return packed;
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

struct ForwardBf16 {
  const B16 *q, *k, *v;
  const float *beta, *g, *h0;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, g_s[3] = {};
  B16* o;        // [N, NC·C, H, V]
  float* h_out;  // [N·H, K, V]
  int64_t N, H, L, K, V, C, NC;
  float scale;
  FiniteCheck* finite;  // the fused finite check of q, k, v (chunk_common.h)

  // The scratch one task takes, in floats, as run() and chunk() carve it: the shared rows, then
  // each head of a group its own [−W h; O; h].
  struct Layout {
    int64_t R, Ah, Tb, PK, tmp, Kw, Rw, Vw, hw, Uw, SP, Tm, WU, vec, X, total;
  };
  Layout layout() const {
    using fastweights::cpu::packed_b_words;
    const int64_t KV = K + V, ldt = transposed_ld(C);
    auto b16 = [](int64_t count) { return round16((count + 1) / 2); };
    Layout s{};
    int64_t at = 0;
    auto put = [&at](int64_t& field, int64_t floats) { field = at; at += round16(floats); };
    put(s.R, b16(3 * C * KV));                         // rows [−W; Q; K | V], ld K + V
    put(s.Ah, b16(C * C));                             // T diag(β e^b) (ungated: T diag(β))
    put(s.Tb, b16(C * C));                             // T diag(β) (gated)
    put(s.PK, b16((C + K) * ldt));                     // [P; K̄ᵀ], ld transposed_ld(C)
    put(s.tmp, b16(C * K) + (C + 1) / 2 * round16(K));  // transpose_keys' scratch
    put(s.Kw, packed_b_words(K, C));                   // Kᵀ, packed
    put(s.Rw, packed_b_words(C, KV));                  // K | V (ungated) or K (gated), packed
    put(s.Vw, packed_b_words(C, V));                   // V (gated), packed
    put(s.hw, packed_b_words(K, V));                   // h, packed
    put(s.Uw, packed_b_words(C, V));                   // U', packed
    put(s.SP, 2 * C * C);                              // [P; S]
    put(s.Tm, C * C);                                  // T
    put(s.WU, C * KV);                                 // [W | U]
    put(s.vec, 5 * round16(C));                        // β, b, e^b, e^{b_C − b}, β e^b
    s.X = at;                                          // per head of a group: [−W h; O; h], ld V
    s.total = at + group() * x_floats();
    return s;
  }
  int64_t scratch_size() const { return layout().total; }
  int64_t x_floats() const { return round16((2 * C + K) * V); }
  // Heads worked on side by side, chunk by chunk (each keeps its state and its [−W h; O] rows):
  // the heads of one token are adjacent in memory, so a group reads each chunk's input rows as
  // longer runs than one head's row; as many as keep the group's states within about 1 MiB.
  int64_t group() const { return std::max<int64_t>(1, std::min<int64_t>(kMaxGroup, (int64_t(1) << 18) / x_floats())); }
  static constexpr int64_t kMaxGroup = 8;

  // Tasks begin .. end (sequence·H + head), in groups of group() heads, chunk by chunk.
  void run(int64_t begin, int64_t end, float* scratch) const {
    const Layout s = layout();
    const int64_t G = group();
    fastweights::cpu::Workspace ws;
    HeadRows<B16, float> in[kMaxGroup];
    int64_t bad[kMaxGroup][3];
    for (int64_t first = begin; first < end; first += G) {
      const int64_t heads = std::min(G, end - first);
      for (int64_t j = 0; j < heads; ++j) {
        const int64_t nh = first + j, n = nh / H, hh = nh % H;
        float* h = scratch + s.X + j * x_floats() + 2 * C * V;
        if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(float) * K * V);
        else std::fill(h, h + K * V, 0.f);
        in[j] = HeadRows<B16, float>::at(n, hh, q, q_s, k, k_s, v, v_s, beta, beta_s, g, g_s, L, K, V, C);
        std::fill(bad[j], bad[j] + 3, int64_t(0));
      }
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t j = 0; j < heads; ++j)
          chunk(first + j, c, in[j], scratch, scratch + s.X + j * x_floats(), ws, finite->on() ? bad[j] : nullptr);
      fastweights::cpu::store_fence();
      fastweights::cpu::gemm_bf16_release();
      for (int64_t j = 0; j < heads; ++j) {
        std::memcpy(h_out + (first + j) * K * V, scratch + s.X + j * x_floats() + 2 * C * V, sizeof(float) * K * V);
        if (finite->on()) finite->add(bad[j]);
      }
    }
  }

  // Chunk c of head nh: X is the head's own [−W h; O; h] rows (h its state), the rest of the
  // scratch shared; count (nullptr: no check) its non-finite counts of q, k, v.
  void chunk(int64_t nh, int64_t c, const HeadRows<B16, float>& in, float* scratch, float* X,
             fastweights::cpu::Workspace& ws, int64_t* count) const {
    using fastweights::cpu::gemm_bf16_packed;
    using fastweights::cpu::pack_b;
    using fastweights::cpu::to_bf16;
    using fastweights::cpu::to_bf16_scaled;
    using fastweights::cpu::to_bf16_times;
    const int64_t n = nh / H, hh = nh % H, KV = K + V, ldt = transposed_ld(C);
    const Layout s = layout();
    auto b16 = [scratch](int64_t at) { return reinterpret_cast<B16*>(scratch + at); };
    auto w32 = [scratch](int64_t at) { return reinterpret_cast<uint32_t*>(scratch + at); };
    B16* Wr = b16(s.R);     // −W (columns 0..K)
    B16* Qr = Wr + C * KV;  // Q (columns 0..K)
    B16* KVr = Qr + C * KV; // K | V
    B16* Ah = b16(s.Ah);
    B16* Tb = b16(s.Tb);
    B16* PK = b16(s.PK);
    B16* tmp16 = b16(s.tmp);
    uint32_t* tmpw = w32(s.tmp + round16((C * K + 1) / 2));
    float* P = scratch + s.SP;
    float* S = P + C * C;
    float* Tm = scratch + s.Tm;
    float* WU = scratch + s.WU;
    float* WH = X;  // [−W h; O; h] with one leading dimension V
    float* O = WH + C * V;
    float* h = O + C * V;
    float* bvec = scratch + s.vec;
    float* bcum = bvec + round16(C);
    float* rd = bcum + round16(C);
    float* te = rd + round16(C);
    float* wk = te + round16(C);
    const bool gated = g != nullptr;
    const int64_t t0 = c * C;
    gather(in, t0, Qr, KVr, bvec, bcum, count);
    int64_t part = 0;
    auto ahead = [&]() { in.prefetch_part(t0 + C, part++, kAheadParts); };
    if (gated) chunk_decays(C, bcum, rd, te);
    // [P; S] = [Q; K] Kᵀ (P unscaled), masked
    gemm_bf16_packed(false, 2 * C, C, K, 1.f, Qr, KV, pack_b(true, K, C, KVr, KV, w32(s.Kw)), 0.f, P, C, ws);
    ahead();
    mask_scores<float>(C, gated ? bcum : nullptr, S, P, nullptr);
    unit_lower_inverse_bf16fwd(C, S, bvec, Tm);
    // [W | U] = T diag(β) [K e^b | V] = [(T diag(β e^b)) K | (T diag(β)) V]
    for (int64_t i = 0; i < C; ++i) wk[i] = gated ? bvec[i] * rd[i] : bvec[i];
    for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, wk, Ah + i * C, C);
    if (gated) {
      for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, bvec, Tb + i * C, C);
      gemm_bf16_packed(false, C, K, C, 1.f, Ah, C, pack_b(false, C, K, KVr, KV, w32(s.Rw)), 0.f, WU, KV, ws);
      gemm_bf16_packed(false, C, V, C, 1.f, Tb, C, pack_b(false, C, V, KVr + K, KV, w32(s.Vw)), 0.f, WU + K, KV, ws);
    } else {
      gemm_bf16_packed(false, C, KV, C, 1.f, Ah, C, pack_b(false, C, KV, KVr, KV, w32(s.Rw)), 0.f, WU, KV, ws);
    }
    ahead();
    // [−W h; O] = [−W; Q] h, and h ← e^{b_C} h for the state's update; U' = U + (−W h)
    const auto hp = pack_state(K, V, h, gated ? rd[C - 1] : 1.f, w32(s.hw));
    for (int64_t i = 0; i < C; ++i) to_bf16_scaled(WU + i * KV, -1.f, Wr + i * KV, K);
    gemm_bf16_packed(false, 2 * C, V, K, 1.f, Wr, KV, hp, 0.f, WH, V, ws);
    ahead();
    const auto Upk = pack_sum(C, V, WU + K, KV, WH, V, w32(s.Uw));
    // [O; h] += [P; K̄ᵀ] U', after O ← diag(e^b) O
    if (gated) {
      for (int64_t i = 0; i < C; ++i) {
        const float r = rd[i];
        float* row = O + i * V;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) row[j] *= r;
      }
    }
    for (int64_t i = 0; i < C; ++i) to_bf16(P + i * C, PK + i * ldt, C);
    transpose_keys(C, K, KVr, KV, gated ? te : nullptr, PK + C * ldt, ldt, tmp16, tmpw);
    ahead();
    gemm_bf16_packed(false, C + K, V, C, 1.f, PK, ldt, Upk, 1.f, O, V, ws);
    ahead();
    for (int64_t i = 0; i < C; ++i)
      fastweights::cpu::to_bf16_scaled_stream(O + i * V, scale, o + ((n * NC * C + t0 + i) * H + hh) * V, V);
  }

  // The chunk at t0 into Qr (q, ld K + V) and KVr (k | v), rows past the end zero; β and g into
  // bvec / bcum; bad (nullptr: no check) counts q's, k's and v's NaN/Inf entries.
  void gather(const HeadRows<B16, float>& in, int64_t t0, B16* Qr, B16* KVr, float* bvec, float* bcum,
              int64_t* bad) const {
    const int64_t rows = std::max<int64_t>(0, std::min(C, L - t0)), KV = K + V;
    bool any = false, copied = false;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (fastweights::cpu::isa() > fastweights::cpu::kPortable) {
      // the finite check on the way: each entry's exponent bits, inverted, into a running minimum
      // (zero only for NaN/±Inf), while the rows are in registers anyway
      __m512i low = _mm512_set1_epi16(0x7f80);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = t0 + i;
        copy_row_checked(in.q + t * in.q_t, Qr + i * KV, K, low);
        copy_row_checked(in.k + t * in.k_t, KVr + i * KV, K, low);
        copy_row_checked(in.v + t * in.v_t, KVr + i * KV + K, V, low);
      }
      any = _mm512_cmpeq_epi16_mask(low, _mm512_setzero_si512()) != 0;
      copied = true;
    }
#endif
    if (!copied) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = t0 + i;
        std::memcpy(Qr + i * KV, in.q + t * in.q_t, sizeof(B16) * K);
        std::memcpy(KVr + i * KV, in.k + t * in.k_t, sizeof(B16) * K);
        std::memcpy(KVr + i * KV + K, in.v + t * in.v_t, sizeof(B16) * V);
      }
      // the finite check once every row is in (K | V's rows in one run; Q's rows, K of each K + V, apart)
      any = bad != nullptr && rows > 0 && any_nonfinite(KVr, rows * KV);
      for (int64_t i = 0; bad != nullptr && i < rows && !any; ++i) any = any_nonfinite(Qr + i * KV, K);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = t0 + i;
      bvec[i] = in.beta[t * in.beta_t];
      bcum[i] = in.g != nullptr ? in.g[t * in.g_t] : 0.f;
    }
    const B16 zero(0.f);
    for (int64_t i = rows; i < C; ++i) {
      std::fill(Qr + i * KV, Qr + i * KV + K, zero);
      std::fill(KVr + i * KV, KVr + (i + 1) * KV, zero);
      bvec[i] = 0.f;
      bcum[i] = 0.f;
    }
    if (bad != nullptr && any) {  // the exact counts, only where there is something to count
      bad[0] += rows_nonfinite(Qr, KV, rows, K);
      bad[1] += rows_nonfinite(KVr, KV, rows, K);
      bad[2] += rows_nonfinite(KVr + K, KV, rows, V);
    }
  }
};

// The bf16-products forward: q, k, v bf16 [N, H, T, ·] (unit last stride), beta / g / h0 fp32.
// Returns (o [N, NC·C, H, V] bf16, h_T [N·H, K, V] fp32). check_finite: the op's name for the
// fused finite check of q, k, v (a ValueError naming the argument), or empty for none.
std::vector<torch::Tensor> chunk_delta_fwd_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                                const torch::Tensor& beta, const c10::optional<torch::Tensor>& g,
                                                const c10::optional<torch::Tensor>& h0, double scale, int64_t C,
                                                const std::string& check_finite) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
              v.scalar_type() == torch::kBFloat16, "chunk_delta_fwd_bf16: q, k, v must be bfloat16");
  TORCH_CHECK(beta.scalar_type() == torch::kFloat && (!g.has_value() || g->scalar_type() == torch::kFloat) &&
              (!h0.has_value() || h0->scalar_type() == torch::kFloat), "chunk_delta_fwd_bf16: beta, g, h0 must be float32");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "chunk_delta_fwd_bf16: last dims must be unit-stride");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  torch::Tensor o = torch::empty({N, NC * C, H, V}, v.options());
  torch::Tensor h_out = torch::empty({N * H, K, V}, beta.options());
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  ForwardBf16 f;
  f.q = q.data_ptr<at::BFloat16>();
  f.k = k.data_ptr<at::BFloat16>();
  f.v = v.data_ptr<at::BFloat16>();
  f.beta = beta.data_ptr<float>();
  f.g = g.has_value() ? g->data_ptr<float>() : nullptr;
  f.h0 = h0.has_value() ? h0c.data_ptr<float>() : nullptr;
  strides3(q, f.q_s);
  strides3(k, f.k_s);
  strides3(v, f.v_s);
  strides3(beta, f.beta_s);
  if (g.has_value()) strides3(*g, f.g_s);
  f.o = o.data_ptr<at::BFloat16>();
  f.h_out = h_out.data_ptr<float>();
  f.N = N; f.H = H; f.L = L; f.K = K; f.V = V; f.C = C; f.NC = NC;
  f.scale = float(scale);
  FiniteCheck finite(check_finite);
  f.finite = &finite;
  per_head_group(f);
  finite.raise_if_any();
  return {o, h_out};
}

}  // namespace

void register_chunk_delta_bf16(pybind11::module& m) {
  namespace py = pybind11;
  m.def("chunk_delta_fwd_bf16", &chunk_delta_fwd_bf16, "the inference forward with bf16 products", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("beta"), py::arg("g"), py::arg("h0"), py::arg("scale"),
        py::arg("chunk_size"), py::arg("check_finite") = "");
}
