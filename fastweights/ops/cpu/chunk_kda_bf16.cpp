// Kimi Delta Attention's chunk forward with bf16 products, on the CPU, one (sequence, head) per
// task, a thread's tasks worked on in groups chunk by chunk (inference: nothing kept for a backward). The algebra is chunk_kda.cpp's
// (Kimi Team 2025, "Kimi Linear", arXiv:2510.26692; the UT transform of Yang et al. 2024,
// arXiv:2406.06484); the products run on gemm_bf16.h's ISA path (AMX tiles, AVX512-BF16, or
// widened to fp32), the shared pieces are chunk_common.h, chunk_bf16.h and chunk_rows.h.
//
// Every product takes bf16 operands and accumulates in fp32; the state, b = cumsum(gk), the
// exponentials, the triangular solve for T and every sum stay fp32. The per-channel decay cannot
// be folded into a C×C factor as the gated delta rule's per-token decay is (chunk_delta_bf16.cpp),
// so the decayed key and query rows are formed in fp32 and each is rounded to bf16 once, right
// before its product:
//   Q̂ = Q ⊙ e^b,  K̂ = K ⊙ e^b,  Ǩ = K ⊙ e^{−b}
// and the chunk is four products on stacked rows (one leading dimension each, one dispatch each):
//   [P; S]    = [Q̂; K̂] Ǩᵀ             (P unscaled; then the masks)
//   [W | U]   = (T diag(β)) [K̂ | V]    T = (I + diag(β) S)⁻¹ in fp32
//   [−W h; O] = [−W; Q̂] h              (U' = U + (−W h) is formed as it is packed)
//   [O; h]   += [P; Ǩᵀ] U'             then h ← diag(e^{b_C}) h
// The last line is the state update h ← diag(e^{b_C}) h + K̄ᵀ U' with K̄ = K ⊙ e^{b_C − b} =
// diag(e^{b_C}) applied to Ǩ per channel, so K̄ is never formed. O is scaled by the attention scale
// as it is rounded to the output. b is summed in fp32 here (chunk_kda.cpp sums it in float64): an
// error of a few ulp of b moves e^b by far less than its rounding to bf16.
//
// Ǩ = K ⊙ e^{−b} is finite only while b stays bounded. Where every |b| in the chunk is within 60
// (chunk_kda.cpp's whole-chunk test; the common case: a chunk of 64 tokens at −0.05 per token
// spans e^{−3}) the chunk runs as above. Otherwise (extreme decays) b is summed in float64, that
// chunk's S and P are summed pair by pair in fp32, Σ_d x_r[d] k_i[d] e^{b_r[d] − b_i[d]} (x = k or
// q), each factor ≤ 1 its own exponential of a float64 difference (more exact than bf16 products,
// at C²K/2 exponentials a chunk), and the state update takes K̄ = K ⊙ e^{b_C − b} (its own
// exponential, ≤ 1) after h ← diag(e^{b_C}) h; the chunk's other products (every factor there
// ≤ 1: nothing overflows) are the bf16 ones above.
//
// Like chunk_kda.cpp's forward, the kernel makes the ops' input checks on the rows it gathers: q, k,
// v finite (FiniteCheck), and gk's non-finite / NaN counts and largest entry per task (decay_stats).
#include "chunk_bf16.h"
#include "chunk_rows.h"

#include <limits>

namespace {

using namespace fastweights::cpu::chunk;
using fastweights::cpu::round16;

// The bound on |b| for the whole-chunk products: e^{±60} is a normal fp32 (and bf16) number.
constexpr double kWholeLimit = 60.0;

// One row (K entries) of a whole chunk's decayed rows on the portable path (the vector path forms
// them in decay_and_rows' one pass), from the bf16 rows q, k and the fp32 cumulative decays b:
// Q̂ = q e^b, K̂ = k e^b, Ǩ = k e^{−b}, each product in fp32, rounded once.
inline void whole_rows(int64_t K, const B16* q, const B16* k, const float* b, B16* qe, B16* ke, B16* ki) {
  for (int64_t j = 0; j < K; ++j) {
    const float f = std::exp(b[j]), kf = float(k[j]);
    qe[j] = B16(float(q[j]) * f);
    ke[j] = B16(kf * f);
    ki[j] = B16(kf / f);
  }
}

// One row of the decayed rows of a chunk that is not whole, from the factors f = e^b and
// e2 = e^{b_C − b} (each its own exponential): Q̂ = q f, K̂ = k f, K̄ = k e2.
inline void bounded_rows(int64_t K, const B16* q, const B16* k, const float* f, const float* e2, B16* qe, B16* ke,
                         B16* kb) {
  for (int64_t j = 0; j < K; ++j) {
    const float kf = float(k[j]);
    qe[j] = B16(float(q[j]) * f[j]);
    ke[j] = B16(kf * f[j]);
    kb[j] = B16(kf * e2[j]);
  }
}

struct KdaForwardBf16 : Grid {
  const B16 *q, *k, *v;
  const float *beta, *gk, *h0;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, gk_s[3] = {};
  B16* o;        // [N, NC·C, H, V]
  float* h_out;  // [N·H, K, V]
  float scale;
  FiniteCheck* finite;   // q, k, v (off: an empty op name)
  double* decay_stats;   // [N·H, 3] or null (no check of gk)

  // The scratch one task takes, in floats (bf16 buffers at two to a float).
  struct Layout {
    int64_t R, Qx, Kx, Ki, Kb, Ah, PK, tmp, Kw, Rw, hw, Uw, SP, Tm, WU, X, fac, e2, Qf, Kf, gin, bf, bd, ex, vec, last, owed,
        total;
  };
  Layout layout() const {
    const int64_t KV = K + V, ldt = transposed_ld(C);
    auto b16 = ScratchPlan::bf16s;
    Layout s{};
    ScratchPlan plan;
    plan.put(s.R, b16(3 * C * KV));                   // rows [−W; Q̂; K̂ | V], ld K + V
    plan.put(s.Qx, b16(C * K));                       // q, k as gathered (bf16)
    plan.put(s.Kx, b16(C * K));
    plan.put(s.Ki, b16(C * K));                       // Ǩ
    plan.put(s.Kb, b16(C * K));                       // K̄ (chunks that are not whole)
    plan.put(s.Ah, b16(C * C));                       // T diag(β)
    plan.put(s.PK, b16((C + K) * ldt));               // [P; K̄ᵀ], ld transposed_ld(C)
    plan.put(s.tmp, b16(C * K) + (C + 1) / 2 * round16(K));  // transpose_keys' scratch
    plan.put(s.Kw, packed_b_words(K, C));             // Ǩᵀ, packed
    plan.put(s.Rw, packed_b_words(C, KV));            // K̂ | V, packed
    plan.put(s.hw, packed_b_words(K, V));             // h, packed
    plan.put(s.Uw, packed_b_words(C, V));             // U', packed
    plan.put(s.SP, 2 * C * C);                        // [P; S]
    plan.put(s.Tm, C * C);                            // T
    plan.put(s.WU, C * KV);                           // [W | U]
    plan.put(s.fac, C * K);                           // e^b
    plan.put(s.e2, C * K);                            // e^{b_C − b} (chunks that are not whole)
    plan.put(s.Qf, C * K);                            // q, k widened (the pair-by-pair S and P; Qf also
                                                      // the portable path's extremes of b)
    plan.put(s.Kf, C * K);
    plan.put(s.gin, C * K);                           // gk's rows
    plan.put(s.bf, C * K);                            // b = cumsum(gk) (the portable path)
    plan.put(s.bd, 2 * C * K);                        // b (float64)
    plan.put(s.ex, 2 * C * K);                        // float64 exponents
    plan.put(s.vec, round16(C));                      // β
    plan.put(s.last, round16(K));                     // e^{b_C}
    plan.put(s.owed, kMaxGroup * round16(K));         // per head of a group: the e^{b_C} still owed to its state
    s.X = plan.at;                                    // per head of a group: [−W h; O; h], ld V
    s.total = plan.at + group() * x_floats();
    return s;
  }
  int64_t scratch_size() const { return layout().total; }
  int64_t x_floats() const { return head_rows_floats(C, K, V); }
  int64_t group() const { return head_group(C, K, V); }  // heads worked on side by side (chunk_bf16.h)

  // One head's running sums beside its state: q, k, v's non-finite counts and gk's check counts.
  struct Tally {
    int64_t bad[3] = {0, 0, 0}, decay_bad = 0, decay_nan = 0;
    float decay_high = -std::numeric_limits<float>::infinity();
  };

  // Tasks begin .. end (sequence·H + head), in groups of group() heads, chunk by chunk (as
  // chunk_delta_bf16.cpp works its tasks: a token's heads are adjacent in memory, so a group reads
  // each chunk's input rows, gk's above all, as longer runs than one head's).
  void run(int64_t begin, int64_t end, float* scratch) const {
    const Layout s = layout();
    const int64_t G = group();
    fastweights::cpu::Workspace ws;
    Tally tally[kMaxGroup];
    bool owing[kMaxGroup];
    for (int64_t first = begin; first < end; first += G) {
      const int64_t heads = std::min(G, end - first);
      for (int64_t j = 0; j < heads; ++j) {
        float* h = scratch + s.X + j * x_floats() + 2 * C * V;
        if (h0 != nullptr) std::memcpy(h, h0 + (first + j) * K * V, sizeof(float) * K * V);
        else std::fill(h, h + K * V, 0.f);
        tally[j] = Tally{};
        owing[j] = false;
      }
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t j = 0; j < heads; ++j)
          chunk(first + j, c, scratch, scratch + s.X + j * x_floats(), ws, tally[j], scratch + s.owed + j * round16(K),
                owing[j]);
      fastweights::cpu::store_fence();
      fastweights::cpu::gemm_bf16_release();
      for (int64_t j = 0; j < heads; ++j) {
        const int64_t nh = first + j;
        const float* h = scratch + s.X + j * x_floats() + 2 * C * V;
        const float* owed = scratch + s.owed + j * round16(K);
        store_state_by(K, V, h, [owed](int64_t i) { return owed[i]; }, owing[j], h_out + nh * K * V);
        if (finite->on()) finite->add(tally[j].bad);
        if (decay_stats != nullptr) {
          decay_stats[3 * nh] = double(tally[j].decay_bad);
          decay_stats[3 * nh + 1] = double(tally[j].decay_nan);
          decay_stats[3 * nh + 2] = double(tally[j].decay_high);
        }
      }
    }
  }

  // Chunk c of head nh: X is the head's own [−W h; O; h] rows (h its state), the rest of the
  // scratch shared; tally the head's check counts. Where owing, the head's state is still owed the
  // per-channel decay `owed` (K entries: diag(owed) h is the state), which this chunk applies as it
  // packs h; a whole chunk leaves its own e^{b_C} owed the same way (one pass over h less).
  void chunk(int64_t nh, int64_t c, float* scratch, float* X, fastweights::cpu::Workspace& ws, Tally& tally,
             float* owed, bool& owing) const {
    const int64_t n = nh / H, hh = nh % H, KV = K + V, ldt = transposed_ld(C);
    const Layout s = layout();
    const ScratchView mem{scratch};
    B16* Wr = mem.b16(s.R);      // −W (columns 0..K)
    B16* Qr = Wr + C * KV;   // Q̂ (columns 0..K)
    B16* KVr = Qr + C * KV;  // K̂ | V
    B16 *Qx = mem.b16(s.Qx), *Kx = mem.b16(s.Kx), *Ki = mem.b16(s.Ki), *Kb = mem.b16(s.Kb), *Ah = mem.b16(s.Ah), *PK = mem.b16(s.PK);
    B16* tmp16 = mem.b16(s.tmp);
    uint32_t* tmpw = mem.w32(s.tmp + round16((C * K + 1) / 2));
    float* P = scratch + s.SP;
    float* S = P + C * C;
    float *Tm = scratch + s.Tm, *WU = scratch + s.WU, *fac = scratch + s.fac, *e2 = scratch + s.e2;
    float *Qf = scratch + s.Qf, *Kf = scratch + s.Kf, *gin = scratch + s.gin, *bf = scratch + s.bf, *bvec = scratch + s.vec,
          *last = scratch + s.last;
    double* bd = reinterpret_cast<double*>(scratch + s.bd);
    double* ex = reinterpret_cast<double*>(scratch + s.ex);
    float* WH = X;  // [−W h; O; h], one leading dimension V
    float* O = WH + C * V;
    float* h = O + C * V;
    const B16* qh = q + n * q_s[0] + hh * q_s[1];
    const B16* kh = k + n * k_s[0] + hh * k_s[1];
    const B16* vh = v + n * v_s[0] + hh * v_s[1];
    const float* bh = beta + n * beta_s[0] + hh * beta_s[1];
    const float* gh = gk + n * gk_s[0] + hh * gk_s[1];
    const int64_t t0 = c * C, rows = std::min(C, L - t0);
    // No software prefetch of the next chunk's rows: on the Xeon with AMX, asking for them in four
    // parts between the products (as chunk_delta_bf16.cpp does) made this forward 5-12 % slower
    // at B 1, T 2048, H 8, K = V = 128, at 1 and 2 threads (the prefetches stalled on the fill
    // buffers that the gathers need); the rows' own gather is a plain copy instead. Summing gk
    // straight from the input rows (no copy into gin) was 4-9 % slower than this copy, too.
    gather(qh, kh, vh, bh, gh, t0, rows, Qx, Kx, KVr, gin, bvec, finite->on() ? tally.bad : nullptr);
    // b = cumsum(gk) (rows past the end: gk = 0) in fp32 and its largest magnitude, gk's largest
    // entry and whether any is NaN or ±Inf (the decay check's counts), and, where the chunk is whole,
    // its decayed rows Q̂, K̂, Ǩ and e^{b_C}: one pass (decay_and_rows)
    bool decay_odd = false;
    const float high = decay_and_rows(gin, rows, Qx, Kx, Qr, KVr, Ki, last, bf, Qf, tally.decay_high, decay_odd);
    if (decay_stats != nullptr && decay_odd)  // the exact counts, only where there is something to count
      for (int64_t i = 0; i < rows * K; ++i) {
        tally.decay_bad += !std::isfinite(gin[i]);
        tally.decay_nan += std::isnan(gin[i]);
      }
    const bool whole = high <= kWholeLimit;
    if (!whole) {
      // b again in float64, and each factor its own exponential of a float64 number (file comment)
      for (int64_t j = 0; j < K; ++j) bd[j] = double(gin[j]);
      for (int64_t i = 1; i < C; ++i)
        for (int64_t j = 0; j < K; ++j) bd[i * K + j] = bd[(i - 1) * K + j] + double(gin[i * K + j]);
      exp_of(bd, fac, C * K);
      std::memcpy(last, fac + (C - 1) * K, sizeof(float) * K);
      const double* bC = bd + (C - 1) * K;
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < K; ++j) ex[i * K + j] = bC[j] - bd[i * K + j];
      exp_of(ex, e2, C * K);
      for (int64_t i = 0; i < C; ++i)
        bounded_rows(K, Qx + i * K, Kx + i * K, fac + i * K, e2 + i * K, Qr + i * KV, KVr + i * KV, Kb + i * K);
    }
    if (whole) {
      // [P; S] = [Q̂; K̂] Ǩᵀ, then the masks
      gemm_bf16_packed(false, 2 * C, C, K, 1.f, Qr, KV, pack_b(true, K, C, Ki, K, mem.w32(s.Kw)), 0.f, P, C, ws);
      mask_scores<float>(C, nullptr, S, P, nullptr);
    } else {
      pair_scores(Qx, Kx, bd, Qf, Kf, ex, e2, S, P);
    }
    unit_lower_inverse_bf16fwd(C, S, bvec, Tm);
    // [W | U] = T diag(β) [K̂ | V]
    for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, bvec, Ah + i * C, C);
    gemm_bf16_packed(false, C, KV, C, 1.f, Ah, C, pack_b(false, C, KV, KVr, KV, mem.w32(s.Rw)), 0.f, WU, KV, ws);
    // [−W h; O] = [−W; Q̂] h; U' = U + (−W h)
    const auto hp = pack_state_rows(K, V, h, owing ? owed : nullptr, mem.w32(s.hw));  // h ← diag(owed) h, packed
    owing = false;
    for (int64_t i = 0; i < C; ++i) to_bf16_scaled<true>(WU + i * KV, -1.f, Wr + i * KV, K);
    gemm_bf16_packed(false, 2 * C, V, K, 1.f, Wr, KV, hp, 0.f, WH, V, ws);
    const auto Upk = pack_sum(C, V, WU + K, KV, WH, V, mem.w32(s.Uw));
    // [O; h] += [P; K̄ᵀ] U' with h ← diag(e^{b_C}) h first; in a whole chunk K̄ = diag(e^{b_C}) Ǩ
    // (per channel), so there h ← diag(e^{b_C}) (h + Ǩᵀ U') instead, K̄ never formed and the
    // decay left owed to the next pack of h (or to the final state)
    if (!whole) scale_rows(K, V, h, last);
    for (int64_t i = 0; i < C; ++i) to_bf16(P + i * C, PK + i * ldt, C);
    transpose_keys(C, K, whole ? Ki : Kb, K, nullptr, PK + C * ldt, ldt, tmp16, tmpw);
    gemm_bf16_packed(false, C + K, V, C, 1.f, PK, ldt, Upk, 1.f, O, V, ws);
    if (whole) {
      std::memcpy(owed, last, sizeof(float) * K);
      owing = true;
    }
    for (int64_t i = 0; i < C; ++i)
      fastweights::cpu::to_bf16_scaled_stream(O + i * V, scale, o + ((n * NC * C + t0 + i) * H + hh) * V, V);
  }

  // b = cumsum(gk) down the chunk's rows (C × K, fp32: an error of a few ulp of b moves e^b by far
  // less than its rounding to bf16) and its largest magnitude, returned; of the first `rows` rows
  // (the others are padding) also gk's largest entry, NaN aside, into top_g, and whether any entry
  // is NaN or ±Inf into odd. Where the largest |b| is within kWholeLimit (a whole chunk) also the
  // chunk's decayed rows from q (Qx) and k (Kx), ld K: Q̂ = q e^b → Qr and K̂ = k e^b → KVr (ld K + V),
  // Ǩ = k e^{−b} → Ki (ld K), and e^{b_C} → last; otherwise what these hold is undefined. The vector
  // path is one pass down each 16 channels, b and its extremes in registers, the decayed rows formed
  // as b is summed (optimistically: a chunk that turns out not whole forms its rows again its own
  // way; e^{b_C} is the last row's factor, exp16f's few ulp, where the portable path takes libm's
  // exp); the portable path sums b into `b` (C × K) first, extremes: 2K floats of scratch.
  float decay_and_rows(const float* gin, int64_t rows, const B16* Qx, const B16* Kx, B16* Qr, B16* KVr, B16* Ki,
                       float* last, float* b, float* extremes, float& top_g, bool& odd) const {
    using namespace fastweights::cpu;
    const int64_t KV = K + V;
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
    if (isa() > kPortable) {
      auto widen = [](__m256i x) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16)); };
      const auto round = [](__m512 x) { return bf16_detail::round_operand(x); };  // as product operands are
      const __m512 two = _mm512_set1_ps(2.f);
      __m512 top = _mm512_setzero_ps(), bottom = _mm512_setzero_ps(), gtop = _mm512_set1_ps(top_g);
      __mmask16 nonfinite = 0;
      for (int64_t j = 0; j < K; j += 16) {
        const __mmask16 live = bf16_detail::live16(K - j);
        __m512 x = _mm512_setzero_ps(), f = x;
        for (int64_t i = 0; i < C; ++i) {
          const __m512 g = _mm512_maskz_loadu_ps(live, gin + i * K + j);
          x = _mm512_add_ps(x, g);
          top = _mm512_max_ps(top, x);
          bottom = _mm512_min_ps(bottom, x);
          if (i < rows) {
            gtop = _mm512_mask_max_ps(gtop, live, g, gtop);  // a NaN in g keeps gtop (vmaxps returns the second)
            nonfinite |= _mm512_mask_fpclass_ps_mask(live, g, 0x99);  // QNaN, ±Inf, SNaN
          }
          const __m512 qf = widen(_mm256_maskz_loadu_epi16(live, Qx + i * K + j));
          const __m512 kf = widen(_mm256_maskz_loadu_epi16(live, Kx + i * K + j));
          f = exp16f(x);
          // e^{−b} = 1 / e^b: the reciprocal estimate and one Newton step (a few ulp of fp32)
          __m512 iv = _mm512_rcp14_ps(f);
          iv = _mm512_mul_ps(iv, _mm512_fnmadd_ps(f, iv, two));
          _mm256_mask_storeu_epi16(Qr + i * KV + j, live, round(_mm512_mul_ps(qf, f)));
          _mm256_mask_storeu_epi16(KVr + i * KV + j, live, round(_mm512_mul_ps(kf, f)));
          _mm256_mask_storeu_epi16(Ki + i * K + j, live, round(_mm512_mul_ps(kf, iv)));
        }
        _mm512_mask_storeu_ps(last + j, live, f);
      }
      top_g = _mm512_reduce_max_ps(gtop);
      odd = odd || nonfinite != 0;
      return std::max(_mm512_reduce_max_ps(top), -_mm512_reduce_min_ps(bottom));
    }
#endif
    float *top = extremes, *bottom = extremes + K, high = 0.f;
    for (int64_t j = 0; j < K; ++j) top[j] = bottom[j] = b[j] = gin[j];
    for (int64_t i = 1; i < C; ++i)
      for (int64_t j = 0; j < K; ++j) {
        b[i * K + j] = b[(i - 1) * K + j] + gin[i * K + j];
        top[j] = std::max(top[j], b[i * K + j]);
        bottom[j] = std::min(bottom[j], b[i * K + j]);
      }
    for (int64_t j = 0; j < K; ++j) high = std::max(high, std::max(top[j], -bottom[j]));
    for (int64_t i = 0; i < rows * K; ++i) {
      odd = odd || !std::isfinite(gin[i]);
      if (gin[i] > top_g) top_g = gin[i];
    }
    if (high <= kWholeLimit) {
      for (int64_t j = 0; j < K; ++j) last[j] = std::exp(b[(C - 1) * K + j]);
      for (int64_t i = 0; i < C; ++i) whole_rows(K, Qx + i * K, Kx + i * K, b + i * K, Qr + i * KV, KVr + i * KV, Ki + i * K);
    }
    return high;
  }

  // The chunk at t0 (rows of it before the end): q → Qx, k → Kx (ld K), v → the V columns of KVr
  // (ld K + V), gk → gin, β → bvec; rows past the end zero. bad (nullptr: no check) counts q's, k's
  // and v's NaN/Inf entries.
  void gather(const B16* qh, const B16* kh, const B16* vh, const float* bh, const float* gh, int64_t t0, int64_t rows,
              B16* Qx, B16* Kx, B16* KVr, float* gin, float* bvec, int64_t* bad) const {
    const int64_t KV = K + V;
    gather_qkv_checked(qh, q_s[2], kh, k_s[2], vh, v_s[2], t0, rows, C, K, V, Qx, K, Kx, K, KVr + K, KV, bad);
    for (int64_t i = 0; i < C; ++i) {
      const int64_t t = t0 + i;
      if (i < rows) std::memcpy(gin + i * K, gh + t * gk_s[2], sizeof(float) * K);
      else std::fill(gin + i * K, gin + (i + 1) * K, 0.f);
      bvec[i] = i < rows ? bh[t * beta_s[2]] : 0.f;
    }
  }


  // S (strictly lower) and P (lower, unscaled) of a chunk whose decays are not bounded (file
  // comment): each entry Σ_d x_r[d] k_i[d] e^{b_r[d] − b_i[d]} in fp32 from the bf16 rows q (Qx) and
  // k (Kx), widened into Qf / Kf; the factors e^{b_r − b_i} (≤ 1 for a decay) into fr, their
  // float64 exponents into er.
  void pair_scores(const B16* Qx, const B16* Kx, const double* bd, float* Qf, float* Kf, double* er, float* fr, float* S,
                   float* P) const {
    for (int64_t i = 0; i < C * K; ++i) {
      Qf[i] = float(Qx[i]);
      Kf[i] = float(Kx[i]);
    }
    std::fill(S, S + C * C, 0.f);
    std::fill(P, P + C * C, 0.f);
    for (int64_t r = 0; r < C; ++r) {
      // the row's exponents b_r − b_i for every i ≤ r at once, then their exponentials
      for (int64_t i = 0; i <= r; ++i)
        for (int64_t d = 0; d < K; ++d) er[i * K + d] = bd[r * K + d] - bd[i * K + d];
      exp_of(er, fr, (r + 1) * K);
      const float *__restrict kr = Kf + r * K, *__restrict qr = Qf + r * K;
      for (int64_t i = 0; i <= r; ++i) {
        const float *__restrict ki = Kf + i * K, *__restrict f = fr + i * K;
        float sv = 0.f, pv = 0.f;
#pragma omp simd reduction(+ : sv, pv)
        for (int64_t d = 0; d < K; ++d) {
          const float y = ki[d] * f[d];
          sv += kr[d] * y;
          pv += qr[d] * y;
        }
        if (i < r) S[r * C + i] = sv;
        P[r * C + i] = pv;
      }
    }
  }
};

// The bf16-products forward: q, k, v bf16 [N, H, T, ·] (unit last stride), beta [N, H, T], gk
// [N, H, T, K] and h0 [N·H, K, V] fp32. Returns (o [N, NC·C, H, V] bf16, h_T [N·H, K, V] fp32,
// decay_stats [N·H, 3] float64, empty unless check_decay). check_finite: the op's name for the
// fused finite check of q, k, v (a ValueError naming the argument), or empty for none.
std::vector<torch::Tensor> chunk_kda_fwd_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              const torch::Tensor& beta, const torch::Tensor& gk,
                                              const c10::optional<torch::Tensor>& h0, double scale, int64_t C,
                                              const std::string& check_finite, bool check_decay) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
              v.scalar_type() == torch::kBFloat16, "chunk_kda_fwd_bf16: q, k, v must be bfloat16");
  TORCH_CHECK(beta.scalar_type() == torch::kFloat && gk.scalar_type() == torch::kFloat &&
              (!h0.has_value() || h0->scalar_type() == torch::kFloat), "chunk_kda_fwd_bf16: beta, gk, h0 must be float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && gk.dim() == 4 && beta.dim() == 3,
              "chunk_kda_fwd_bf16: q, k, v, gk must be [N, H, T, ·] and beta [N, H, T]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && gk.stride(3) == 1,
              "chunk_kda_fwd_bf16: last dims must be unit-stride");
  TORCH_CHECK(C > 0, "chunk_kda_fwd_bf16: the chunk size must be positive");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  torch::Tensor o = torch::empty({N, NC * C, H, V}, v.options());
  torch::Tensor h_out = torch::empty({N * H, K, V}, beta.options());
  torch::Tensor stats = torch::empty({check_decay ? N * H : 0, 3}, beta.options().dtype(torch::kDouble));
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  KdaForwardBf16 f;
  static_cast<Grid&>(f) = Grid{N, H, L, K, V, C, NC};
  f.q = rows_of<B16>(q, f.q_s);
  f.k = rows_of<B16>(k, f.k_s);
  f.v = rows_of<B16>(v, f.v_s);
  f.beta = rows_of<float>(beta, f.beta_s);
  f.gk = rows_of<float>(gk, f.gk_s);
  f.h0 = h0.has_value() ? h0c.data_ptr<float>() : nullptr;
  f.o = o.data_ptr<at::BFloat16>();
  f.h_out = h_out.data_ptr<float>();
  f.scale = float(scale);
  FiniteCheck finite(check_finite);
  f.finite = &finite;
  f.decay_stats = data_if<double>(check_decay, stats);
  per_head_group(f);
  finite.raise_if_any();
  return {o, h_out, stats};
}

}  // namespace

void register_chunk_kda_bf16(pybind11::module& m) {  // called by module.cpp's PYBIND11_MODULE
  namespace py = pybind11;
  m.def("chunk_kda_fwd_bf16", &chunk_kda_fwd_bf16, "KDA's inference chunk forward with bf16 products", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("beta"), py::arg("gk"), py::arg("h0"), py::arg("scale"),
        py::arg("chunk_size"), py::arg("check_finite") = "", py::arg("check_decay") = false);
}
