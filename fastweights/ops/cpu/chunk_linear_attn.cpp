// Linear attention's chunk forward and backward on the CPU, one (sequence, head) per task (the
// forward works a thread's tasks in groups, chunk by chunk: Forward::group).
//
// The algebra is fastweights/ops/linear_attn/chunk.py's (Yang et al. 2024, arXiv:2312.06635,
// the chunkwise form; the delta rule's with W = 0 and U = V). Per chunk of C tokens with the
// scalar log decay g (b = cumsum(g) inside the chunk, Γ[r, i] = e^{b_r − b_i}; all 1 without g):
//   P  = scale · lower(Q Kᵀ ⊙ Γ)
//   O  = scale · (Q ⊙ e^b) h + P V
//   h ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ V
// The normalizer (normalize=True) arrives as one more value column of ones (the front end's
// (S, z) pair), so the kernel sees V + 1 columns and needs no case of its own.
//
// Backward, last chunk first, with dh the gradient of the state leaving the chunk:
//   dV = Pᵀ dO + K̄ dh                 dh_c = e^{b_C} dh + scale · Q_bᵀ dO
//   dP = dO Vᵀ, dQ_b = scale · dO hᵀ, dK̄ = V dhᵀ
//   dQ = dQ_b ⊙ e^b + (dP ⊙ Γ · scale) K,   dK = dK̄ ⊙ e^{b_C − b} + (dP ⊙ Γ · scale)ᵀ Q
//   db_r = Σ dQ_b ⊙ Q_b − Σ dK̄ ⊙ K̄ + Σ_i (dP ⊙ P)[r, i] − Σ_i (dP ⊙ P)[i, r],
//   db_C += Σ dK̄ ⊙ K̄ + e^{b_C} ⟨h, dh⟩,   dg = the reverse cumsum of db inside the chunk.
#include "chunk_rows.h"

namespace {

using namespace fastweights::cpu::chunk;

// In the backward, b = cumsum(g), e^b and e^{b_C − b} are chunk_common.h's chunk_decays; P's mask
// and decay Γ its mask_scores (without S), and the gate's gradient its read_write_gate_grad: the
// delta rule's. The forward forms its decays itself, in float64 (Forward::chunk).

// Kᵀ of a chunk's C rows (row i at src + i·lds; rows at or past `rows` are zeros) into dst
// [width, C] (ld ldd), row i scaled by f[i] on the way (f == nullptr: no scaling). 16 × 16 tiles
// transposed in registers where the ISA level allows; the scalar loop elsewhere and at the edges.
template <typename T>
void transpose_rows(const T* src, int64_t lds, int64_t rows, int64_t C, int64_t width, const T* f, T* dst,
                    int64_t ldd) {
  int64_t i0 = 0, j_end = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (fastweights::cpu::isa() > fastweights::cpu::kPortable) {
      j_end = width / 16 * 16;
      const int64_t i_end = std::min(rows, C) / 16 * 16;
      for (; i0 < i_end; i0 += 16) {
        for (int64_t j0 = 0; j0 < j_end; j0 += 16) {
          __m512 r[16], t[16];
          for (int a = 0; a < 16; ++a) {
            r[a] = _mm512_loadu_ps(src + (i0 + a) * lds + j0);
            if (f != nullptr) r[a] = _mm512_mul_ps(r[a], _mm512_set1_ps(f[i0 + a]));
          }
          // pairs interleaved inside 128-bit lanes, then quads, then lanes across registers
          for (int a = 0; a < 16; a += 2) {
            t[a] = _mm512_unpacklo_ps(r[a], r[a + 1]);
            t[a + 1] = _mm512_unpackhi_ps(r[a], r[a + 1]);
          }
          for (int a = 0; a < 16; a += 4) {
            r[a] = _mm512_shuffle_ps(t[a], t[a + 2], 0x44);
            r[a + 1] = _mm512_shuffle_ps(t[a], t[a + 2], 0xEE);
            r[a + 2] = _mm512_shuffle_ps(t[a + 1], t[a + 3], 0x44);
            r[a + 3] = _mm512_shuffle_ps(t[a + 1], t[a + 3], 0xEE);
          }
          // r[4s + c] holds, in lane l, column 4l + c of rows 4s .. 4s + 3
          for (int c = 0; c < 4; ++c) {
            const __m512 v02 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), v13 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
            const __m512 w02 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
            const __m512 w13 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
            T* d = dst + (j0 + c) * ldd + i0;
            _mm512_storeu_ps(d, _mm512_shuffle_f32x4(v02, w02, 0x88));            // column c
            _mm512_storeu_ps(d + 4 * ldd, _mm512_shuffle_f32x4(v13, w13, 0x88));  // c + 4
            _mm512_storeu_ps(d + 8 * ldd, _mm512_shuffle_f32x4(v02, w02, 0xDD));  // c + 8
            _mm512_storeu_ps(d + 12 * ldd, _mm512_shuffle_f32x4(v13, w13, 0xDD)); // c + 12
          }
        }
      }
    }
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    if (fastweights::cpu::isa() > fastweights::cpu::kPortable) {  // 8 × 8 tiles (AVX2: 16 registers)
      j_end = width / 8 * 8;
      const int64_t i_end = std::min(rows, C) / 8 * 8;
      for (; i0 < i_end; i0 += 8) {
        for (int64_t j0 = 0; j0 < j_end; j0 += 8) {
          __m256 r[8], t[8];
          for (int a = 0; a < 8; ++a) {
            r[a] = _mm256_loadu_ps(src + (i0 + a) * lds + j0);
            if (f != nullptr) r[a] = _mm256_mul_ps(r[a], _mm256_set1_ps(f[i0 + a]));
          }
          // pairs interleaved inside 128-bit lanes, then quads: t[4s + c] holds column c of rows
          // 4s .. 4s + 3 in its low lane and column c + 4 in its high lane
          for (int a = 0; a < 8; a += 2) {
            const __m256 lo = _mm256_unpacklo_ps(r[a], r[a + 1]), hi = _mm256_unpackhi_ps(r[a], r[a + 1]);
            r[a] = lo;
            r[a + 1] = hi;
          }
          for (int a = 0; a < 8; a += 4) {
            t[a] = _mm256_shuffle_ps(r[a], r[a + 2], 0x44);
            t[a + 1] = _mm256_shuffle_ps(r[a], r[a + 2], 0xEE);
            t[a + 2] = _mm256_shuffle_ps(r[a + 1], r[a + 3], 0x44);
            t[a + 3] = _mm256_shuffle_ps(r[a + 1], r[a + 3], 0xEE);
          }
          for (int c = 0; c < 4; ++c) {  // the lanes across registers
            T* d = dst + (j0 + c) * ldd + i0;
            _mm256_storeu_ps(d, _mm256_permute2f128_ps(t[c], t[4 + c], 0x20));            // column c
            _mm256_storeu_ps(d + 4 * ldd, _mm256_permute2f128_ps(t[c], t[4 + c], 0x31));  // c + 4
          }
        }
      }
    }
  }
#endif
  // what the tiles left: columns j_end .. width of the tiled rows, then every column of the rest
  for (int64_t j = j_end; j < width; ++j)
    for (int64_t i = 0; i < i0; ++i) dst[j * ldd + i] = src[i * lds + j] * (f != nullptr ? f[i] : T(1));
  for (int64_t j = 0; j < width; ++j)
    for (int64_t i = i0; i < C; ++i) dst[j * ldd + i] = i < rows ? src[i * lds + j] * (f != nullptr ? f[i] : T(1)) : T(0);
}

// Whether any entry of `rows` rows of `width` entries, `ld` apart, is NaN or ±Inf (chunk_common.h's
// any_nonfinite): for fp32 above the portable level, one running minimum of the inverted exponent
// bits over all the rows, reduced once (any_nonfinite row by row reduces each row on its own).
template <typename T>
bool rows_any_nonfinite(const T* x, int64_t ld, int64_t rows, int64_t width) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (fastweights::cpu::isa() > fastweights::cpu::kPortable) {
      const __m512i e = _mm512_set1_epi32(0x7f800000);
      const int64_t whole = width / 16 * 16;
      const __mmask16 tail = static_cast<__mmask16>((1u << (width - whole)) - 1u);  // masked-off lanes read 0
      __m512i low = e;
      for (int64_t i = 0; i < rows; ++i) {
        const T* r = x + i * ld;
        for (int64_t j = 0; j < whole; j += 16)
          low = _mm512_min_epu32(low, _mm512_andnot_si512(_mm512_loadu_si512(r + j), e));
        if (tail != 0) low = _mm512_min_epu32(low, _mm512_andnot_si512(_mm512_maskz_loadu_epi32(tail, r + whole), e));
      }
      return _mm512_cmpeq_epi32_mask(low, _mm512_setzero_si512()) != 0;
    }
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    if (fastweights::cpu::isa() > fastweights::cpu::kPortable) {
      const __m256i e = _mm256_set1_epi32(0x7f800000);
      const int64_t whole = width / 8 * 8;
      __m256i low = e;
      for (int64_t i = 0; i < rows; ++i) {
        const T* r = x + i * ld;
        for (int64_t j = 0; j < whole; j += 8)
          low = _mm256_min_epu32(low, _mm256_andnot_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + j)), e));
        if (whole < width && any_nonfinite(r + whole, width - whole)) return true;  // the row's last entries
      }
      return _mm256_movemask_epi8(_mm256_cmpeq_epi32(low, _mm256_setzero_si256())) != 0;
    }
  }
#endif
  for (int64_t i = 0; i < rows; ++i)
    if (any_nonfinite(x + i * ld, width)) return true;
  return false;
}

// E: the type of q, k, v and o — T, or bf16 (inference only, T = float: the rows widened to fp32 as
// they are gathered into scratch, the output rows rounded to bf16 once as they are written, as
// torch's .to(bfloat16) rounds; the arithmetic is the fp32 kernel's on the widened inputs).
template <typename T, typename E = T>
struct Forward : Grid {
  static constexpr bool kWiden = !std::is_same_v<T, E>;
  const E *q, *k, *v;           // head-first [N, H, T, ·], unit last stride
  const T *g, *h0;              // g [N, H, T]
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, g_s[3] = {};
  E* o;                         // [N, NC·C, H, V]
  T *h_out, *states;            // [N·H, K, V], [NC, N·H, K, V]
  T *qc, *kc, *vc, *gc;         // kept: the flattened chunks [NC·N·H, C, ·] (gc [NC·N·H, C])
  T scale;
  bool keep;
  FiniteCheck* finite;  // the fused finite check of q, k, v (chunk_common.h)

  // Heads worked on side by side, chunk by chunk, each with its own Z (see chunk): the heads of one
  // token are adjacent in the token-major input, so a group reads a chunk's rows as runs G times
  // longer than one head's row, and touches each page of them once. At most as many as keep the
  // group's Z blocks within about 1.25 MiB (8 at K = V = 128, C = 64; at that shape, 1 thread,
  // groups of 1, 2, 4, 8 took 16.1, 14.9, 14.3, 14.2 ms). A head's arithmetic is the same in any
  // group: every Z block is 64-byte aligned with one leading dimension.
  int64_t group() const { return std::clamp<int64_t>((int64_t(5) << 16) / z_size(), 1, kMaxGroup); }
  static constexpr int64_t kMaxGroup = 8;
  int64_t z_size() const { return round16((C + K) * (C + V)); }

  // A group's Z blocks, then Q and V of a chunk gathered where they cannot be read in place (and K
  // for bf16 rows, widened), and the chunk's decays (shared by the group's heads, one after the other).
  int64_t scratch_size() const {
    return group() * z_size() + (kWiden ? 2 : 1) * round16(C * K) + round16(C * V) + 4 * round16(C);
  }

  // Tasks begin .. end (sequence·H + head), in groups of group() heads, chunk by chunk.
  void run(int64_t begin, int64_t end, T* scratch) const {
    const int64_t ldz = C + V, groups = (end - begin + group() - 1) / group();
    const int64_t G = (end - begin + groups - 1) / groups;  // the range in groups of even size
    T* shared = scratch + group() * z_size();
    int64_t bad[kMaxGroup][3] = {};
    for (int64_t first = begin; first < end; first += G) {
      const int64_t heads = std::min(G, end - first);
      for (int64_t j = 0; j < heads; ++j) {  // h, Z's bottom-right [K, V] block, from h0 or zero
        T* h = scratch + j * z_size() + C * ldz;
        for (int64_t r = 0; r < K; ++r) {
          if (h0 != nullptr) std::memcpy(h + r * ldz, h0 + ((first + j) * K + r) * V, sizeof(T) * V);
          else std::fill(h + r * ldz, h + r * ldz + V, T(0));
        }
        std::fill(bad[j], bad[j] + 3, int64_t(0));
      }
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t j = 0; j < heads; ++j) chunk(first + j, c, scratch + j * z_size(), shared, bad[j]);
      fastweights::cpu::store_fence();
      for (int64_t j = 0; j < heads; ++j) {
        const T* h = scratch + j * z_size() + C * ldz;
        for (int64_t r = 0; r < K; ++r) std::memcpy(h_out + ((first + j) * K + r) * V, h + r * ldz, sizeof(T) * V);
        if (finite->on()) finite->add(bad[j]);
      }
    }
  }

  // Chunk c of head nh, in two products, each on operands stacked so that one call does the work
  // of two. Z is the head's [C + K, V + C] block, [Y | X] over [h | K̄ᵀ] (h the state):
  //   [Y | X] = Q [h | K̄ᵀ]                       (Z's top rows from its bottom rows)
  //   [Y; h] ← e^{b_C} [Y; h] + [lower(X); K̄ᵀ] V    (one call: beta = e^{b_C})
  //   O = scale · diag(e^{b − b_C}) Y                (as O is copied out)
  // with K̄ = diag(e^{b_C − b}) K transposed into Z as the chunk is read. This is the chunk's algebra
  // with its decays moved onto row and column factors: row r of Y is e^{b_C} (Q h)_r +
  // Σ_{i≤r} e^{b_C − b_i} (q_r·k_i) v_i, which e^{b_r − b_C} turns into e^{b_r} (Q h)_r + Σ_{i≤r}
  // Γ[r, i] (q_r·k_i) v_i. So P is never decayed, nor O or h in passes of their own. Where the
  // chunk's cumulative decay b leaves [−40, 40] (ratios of e^b that fp32 could under- or overflow)
  // the plain form runs instead: Kᵀ goes in unscaled, P takes Γ itself, Kᵀ is scaled in Z after
  // the first product and O and h are decayed before the second. Each product is split at row C/2
  // (for C ≥ 32) so that the first half of the rows skips the block of X and P above the diagonal
  // (X's columns past C/2 before the mask, P's after): 1/12 of the multiply-adds, for two more
  // calls (at H 8, K = V = 128, C 64, 1 thread: 7 % less time). The products read a whole chunk's
  // rows where they lie in the input (rows `stride` apart, BLAS's leading dimension); the kept
  // buffers when keeping, and zero-padded scratch for the last partial chunk. `bad`: the head's
  // non-finite counts of q, k, v.
  void chunk(int64_t nh, int64_t c, T* Z, T* shared, int64_t* bad) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H, ldo = H * V, ldz = C + V;
    Carve<T> s{shared};
    T *Qs = s.take(C * K), *Vs = s.take(C * V), *Ks = kWiden ? s.take(C * K) : nullptr;
    T *b = s.take(C), *rd = s.take(C), *te = s.take(C), *pr = s.take(C);
    T* O = Z;               // [C, V] at ld ldz: Y, then O before its scaling
    T* X = Z + V;           // [C, C]: X, then P
    T* h = Z + C * ldz;     // [K, V]: the state
    T* KT = h + V;          // [K, C]: K̄ᵀ
    const E* qh = q + n * q_s[0] + hh * q_s[1];
    const E* kh = k + n * k_s[0] + hh * k_s[1];
    const E* vh = v + n * v_s[0] + hh * v_s[1];
    const T* gh = g == nullptr ? nullptr : g + n * g_s[0] + hh * g_s[1];
    const bool in_place = q_s[2] >= K && v_s[2] >= V;  // rows apart (not broadcast)
    const int64_t t0 = c * C, row = c * NH + nh, rows = std::min(C, L - t0);
    // the next chunk's rows, a page apart per token, asked for in parts between the steps: all at
    // once, the requests stall on the fill buffers
    const int64_t ahead = std::clamp<int64_t>(L - t0 - C, 0, C);
    auto prefetch = [&](int part) {
      const int64_t r0 = ahead * part / 3, r1 = ahead * (part + 1) / 3;
      prefetch_rows(qh, q_s[2], t0 + C + r0, r1 - r0, K);
      prefetch_rows(kh, k_s[2], t0 + C + r0, r1 - r0, K);
      prefetch_rows(vh, v_s[2], t0 + C + r0, r1 - r0, V);
    };
    prefetch(0);
    const T *Q, *Km, *Vm;
    int64_t ldq = K, ldk = K, ldv = V;
    if constexpr (kWiden) {  // bf16 rows: all three widened into scratch (no keep)
      gather_rows(qh, q_s[2], t0, L, C, K, Qs, K);
      gather_rows(kh, k_s[2], t0, L, C, K, Ks, K);
      gather_rows(vh, v_s[2], t0, L, C, V, Vs, V);
      Q = Qs; Km = Ks; Vm = Vs;
    } else if (keep) {
      T *qd = qc + row * C * K, *kd = kc + row * C * K, *vd = vc + row * C * V;
      gather_rows(qh, q_s[2], t0, L, C, K, qd, K);
      gather_rows(kh, k_s[2], t0, L, C, K, kd, K);
      gather_rows(vh, v_s[2], t0, L, C, V, vd, V);
      T* st = states + row * K * V;
      for (int64_t r = 0; r < K; ++r) std::memcpy(st + r * V, h + r * ldz, sizeof(T) * V);
      Q = qd; Km = kd; Vm = vd;
    } else if (in_place && t0 + C <= L) {
      Q = qh + t0 * q_s[2]; Km = kh + t0 * k_s[2]; Vm = vh + t0 * v_s[2];
      ldq = q_s[2]; ldk = k_s[2]; ldv = v_s[2];
    } else {
      gather_rows(qh, q_s[2], t0, L, C, K, Qs, K);
      gather_rows(vh, v_s[2], t0, L, C, V, Vs, V);
      Q = Qs; Km = kh + t0 * k_s[2]; Vm = Vs;
      ldk = k_s[2];
    }
    const int64_t krows = keep ? C : rows;  // the kept chunk is zero-padded already
    // the decays: b = cumsum(g) and e^b, summed and exponentiated in float64 and rounded once (an
    // fp32 running sum carries up to ~|b| · 2^-24 · √C of rounding into every e^b); where every
    // |b_r| ≤ 40 (so every ratio below stays inside fp32's range, e^{±80}; NaN never folds) the
    // column factors e^{b_C − b} and O's row factors e^{b_r − b_C} as ratios of e^b (an exponential
    // of the rounded difference would carry up to |b_C − b_r| ulp); else the plain form
    bool fold = gh == nullptr;
    T last = T(1);
    if (gh != nullptr) {
      for (int64_t i = 0; i < C; ++i) b[i] = t0 + i < L ? gh[(t0 + i) * g_s[2]] : T(0);
      if (keep) std::memcpy(gc + row * C, b, sizeof(T) * C);
      fold = true;
      double sum = 0.0;
      for (int64_t i = 0; i < C; ++i) {
        sum += double(b[i]);
        b[i] = T(sum);
        rd[i] = T(std::exp(sum));
        fold = fold && std::abs(sum) <= 40.0;
      }
      if (fold) {
        last = rd[C - 1];
        for (int64_t i = 0; i < C; ++i) {
          te[i] = last / rd[i];
          pr[i] = scale * (rd[i] / last);
        }
      } else {
        for (int64_t i = 0; i < C; ++i) te[i] = std::exp(b[C - 1] - b[i]);
      }
    }
    transpose_rows(Km, ldk, krows, C, K, gh != nullptr && fold ? te : static_cast<const T*>(nullptr), KT, ldz);
    // [Y | X] = Q [h | K̄ᵀ], the first half of the rows without X's columns past them
    const int64_t c1 = C >= 32 ? C / 2 : 0;
    if (c1 > 0) mm<T>(false, false, c1, V + c1, K, T(1), Q, ldq, h, ldz, T(0), Z, ldz);
    mm<T>(false, false, C - c1, V + C, K, T(1), Q + c1 * ldq, ldq, h, ldz, T(0), Z + c1 * ldz, ldz);
    prefetch(1);
    if (fold) {  // P = lower(X) (what was not computed is above the diagonal)
      for (int64_t i = 0; i < C; ++i) std::fill(X + i * ldz + i + 1, X + i * ldz + C, T(0));
    } else {  // the plain form: P = lower(X ⊙ Γ), K̄ᵀ = Kᵀ diag(e^{b_C − b}), O = diag(e^b) Y, h ← e^{b_C} h
      mask_block(b, X, ldz);
      for (int64_t r = 0; r < K; ++r) {
        T* kt = KT + r * ldz;
#pragma omp simd
        for (int64_t i = 0; i < C; ++i) kt[i] *= te[i];
      }
      for (int64_t i = 0; i < C; ++i) {
        T* oi = O + i * ldz;
        const T f = rd[i];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) oi[j] *= f;
      }
      const T decay = rd[C - 1];
      for (int64_t r = 0; r < K; ++r) {
        T* hr = h + r * ldz;
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) hr[j] *= decay;
      }
    }
    // [Y; h] ← e^{b_C} [Y; h] + [P; K̄ᵀ] V (folded; else the decays are in already and beta is 1); P's
    // first c1 rows are zero past column c1
    if (c1 > 0) mm<T>(false, false, c1, V, c1, T(1), X, ldz, Vm, ldv, last, O, ldz);
    mm<T>(false, false, C - c1 + K, V, C, T(1), X + c1 * ldz, ldz, Vm, ldv, last, O + c1 * ldz, ldz);
    prefetch(2);
    E* out = o + (n * NC * C + t0) * ldo + hh * V;
    for (int64_t i = 0; i < C; ++i) {
      const T f = gh != nullptr && fold ? pr[i] : scale;
      if constexpr (kWiden) fastweights::cpu::to_bf16_scaled_stream(O + i * ldz, f, out + i * ldo, V);
      else store_scaled_stream(O + i * ldz, f, out + i * ldo, V);
    }
    if (finite->on()) {  // the chunk's rows, still in cache after its products; counted where there are any
      if (rows_any_nonfinite(Q, ldq, rows, K)) bad[0] += rows_nonfinite(Q, ldq, rows, K);
      if (rows_any_nonfinite(Km, ldk, rows, K)) bad[1] += rows_nonfinite(Km, ldk, rows, K);
      if (rows_any_nonfinite(Vm, ldv, rows, V)) bad[2] += rows_nonfinite(Vm, ldv, rows, V);
    }
  }

  // P (the C × C block at ld ldz) masked to its causal triangle and decayed by Γ[i, j] = e^{b_i − b_j},
  // each factor its own exponential (the wide-decay case: no split into e^{b_i} e^{−b_j}).
  void mask_block(const T* b, T* P, int64_t ldz) const {
    for (int64_t i = 0; i < C; ++i) {
      T* p = P + i * ldz;
      for (int64_t j = 0; j <= i; ++j) p[j] *= std::exp(b[i] - b[j]);
      std::fill(p + i + 1, p + C, T(0));
    }
  }
};

template <typename T>
struct Backward : Grid {
  const T *qc, *kc, *vc, *gc, *states, *dout, *dh_final;  // the forward's kept chunks; do head-first
  int64_t do_s[3] = {};
  T *dq, *dk, *dv, *dg, *dh0;  // [N, NC·C, H, ·] (dg [N, NC·C, H]); dh0 [N·H, K, V]
  T scale;

  int64_t scratch_size() const {
    return 4 * round16(C * K) + round16(C * V) + 3 * round16(C * C) + 2 * round16(K * V) + 4 * round16(C);
  }

  void head(int64_t nh, T* scratch) const {
    const int64_t n = nh / H, hh = nh % H, NH = N * H;
    const bool gated = gc != nullptr;
    Carve<T> s{scratch};
    T *Qb = s.take(C * K), *Kbar = s.take(C * K), *dQb = s.take(C * K), *dKbar = s.take(C * K);
    T *dOs = s.take(C * V);
    T *P = s.take(C * C), *G = s.take(C * C), *dP = s.take(C * C);
    T *dh = s.take(K * V), *dh_new = s.take(K * V);
    T *b = s.take(C), *rd = s.take(C), *te = s.take(C), *db = s.take(C);
    const T* doh = dout + n * do_s[0] + hh * do_s[1];
    const int64_t ldk = H * K, ldv = H * V;  // the token-major gradients' row strides
    std::memcpy(dh, dh_final + nh * K * V, sizeof(T) * K * V);
    for (int64_t c = NC - 1; c >= 0; --c) {
      const int64_t t0 = c * C, row = c * NH + nh;
      const T *Q = qc + row * C * K, *Km = kc + row * C * K, *Vm = vc + row * C * V, *h = states + row * K * V;
      if (c > 0) prefetch_rows(doh, do_s[2], t0 - C, C, V);  // the next (earlier) chunk's dO rows
      // dO where it lies when the chunk is whole (rows do_s[2] apart), else gathered and zero-padded
      const T* dO = dOs;
      int64_t ldo = V;
      if (t0 + C <= L && do_s[2] >= V) {
        dO = doh + t0 * do_s[2];
        ldo = do_s[2];
      } else {
        gather_rows(doh, do_s[2], t0, L, C, V, dOs, V);
      }
      // the chunk's gradients are written straight into the token-major outputs
      const int64_t out_row = n * NC * C + t0;
      T *dqc = dq + out_row * ldk + hh * K, *dkc = dk + out_row * ldk + hh * K, *dvc = dv + out_row * ldv + hh * V;
      mm<T>(false, true, C, C, K, scale, Q, K, Km, K, T(0), P, C);
      if (gated) {
        std::memcpy(b, gc + row * C, sizeof(T) * C);
        chunk_decays(C, b, rd, te);
      }
      mask_scores(C, gated ? b : nullptr, static_cast<T*>(nullptr), P, gated ? G : nullptr);
      const T *qread = Q, *kwrite = Km;
      T last = T(1);
      if (gated) {
        for (int64_t i = 0; i < C; ++i)
          for (int64_t j = 0; j < K; ++j) {
            Qb[i * K + j] = Q[i * K + j] * rd[i];
            Kbar[i * K + j] = Km[i * K + j] * te[i];
          }
        qread = Qb;
        kwrite = Kbar;
        last = rd[C - 1];
      }
      // dV = Pᵀ dO + K̄ dh;  dP = dO Vᵀ;  dQ_b = scale · dO hᵀ;  dK̄ = V dhᵀ
      mm<T>(true, false, C, V, C, T(1), P, C, dO, ldo, T(0), dvc, ldv);
      mm<T>(false, false, C, V, K, T(1), kwrite, K, dh, V, T(1), dvc, ldv);
      mm<T>(false, true, C, C, V, T(1), dO, ldo, Vm, V, T(0), dP, C);
      mm<T>(false, true, C, K, V, scale, dO, ldo, h, V, T(0), dQb, K);
      mm<T>(false, true, C, K, V, T(1), Vm, V, dh, V, T(0), dKbar, K);
      // dh_c = e^{b_C} dh + scale · Q_bᵀ dO
      for (int64_t i = 0; i < K * V; ++i) dh_new[i] = last * dh[i];
      mm<T>(true, false, K, V, C, scale, qread, K, dO, ldo, T(1), dh_new, V);
      if (gated) {
        T d_last = T(0);
        for (int64_t i = 0; i < K * V; ++i) d_last += h[i] * dh[i];
        std::fill(db, db + C, T(0));
        read_write_gate_grad(C, K, Qb, dQb, Kbar, dKbar, P, dP, last, d_last, db);
        T run = T(0);
        for (int64_t i = C - 1; i >= 0; --i) {  // dg = reverse cumsum of db inside the chunk
          run += db[i];
          if (t0 + i < L) dg[(n * NC * C + t0 + i) * H + hh] = run;
        }
      }
      // dP ⊙ Γ · scale on the causal triangle; dQ = dQ_b ⊙ e^b + (..) K; dK = dK̄ ⊙ e^{b_C − b} + (..)ᵀ Q
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < C; ++j)
          dP[i * C + j] = j <= i ? dP[i * C + j] * scale * (gated ? G[i * C + j] : T(1)) : T(0);
      for (int64_t i = 0; i < C; ++i) {
        const T fr = gated ? rd[i] : T(1), ft = gated ? te[i] : T(1);
        for (int64_t j = 0; j < K; ++j) {
          dqc[i * ldk + j] = dQb[i * K + j] * fr;
          dkc[i * ldk + j] = dKbar[i * K + j] * ft;
        }
      }
      mm<T>(false, false, C, K, C, T(1), dP, C, Km, K, T(1), dqc, ldk);
      mm<T>(true, false, C, K, C, T(1), dP, C, Q, K, T(1), dkc, ldk);
      std::swap(dh, dh_new);
    }
    std::memcpy(dh0 + nh * K * V, dh, sizeof(T) * K * V);
  }
};

// Returns (o [N, NC·C, H, V], h_T [N·H, K, V], states [NC, N·H, K, V], qc, kc, vc [NC·N·H, C, ·],
// gc [NC·N·H, C]); states and the flattened chunks are what the backward keeps (empty unless keep;
// gc empty without g). q, k, v fp32 or fp64 (g, h0 of the same dtype), or bf16 with fp32 g, h0 for
// inference (keep false): the fp32 forward on the rows widened as they are gathered, o bf16 (rounded
// once), h_T fp32.
std::vector<torch::Tensor> chunk_linear_attn_fwd(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const c10::optional<torch::Tensor>& g,
                                                 const c10::optional<torch::Tensor>& h0, double scale, int64_t C,
                                                 bool keep, const std::string& check_finite) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "chunk_linear_attn_fwd: q, k, v must be [N, H, T, ·]");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "chunk_linear_attn_fwd: last dims must be unit-stride");
  TORCH_CHECK(C > 0 && C <= 1024, "chunk_linear_attn_fwd: chunk size must be in [1, 1024], got ", C);
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(), "chunk_linear_attn_fwd: one dtype");
  const int64_t N = k.size(0), H = k.size(1), L = k.size(2), K = k.size(3), V = v.size(3), NC = (L + C - 1) / C;
  const bool bf16_io = v.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(!bf16_io || (!keep && (!g.has_value() || g->scalar_type() == torch::kFloat) &&
                           (!h0.has_value() || h0->scalar_type() == torch::kFloat)),
              "chunk_linear_attn_fwd: bf16 q, k, v take float32 g, h0 and are for inference (keep false)");
  // the arithmetic's dtype (the state's, what is kept): v's, or float32 for bf16 rows
  auto opts = bf16_io ? v.options().dtype(torch::kFloat) : v.options();
  torch::Tensor o = torch::empty({N, NC * C, H, V}, v.options()), h_out = torch::empty({N * H, K, V}, opts);
  torch::Tensor states, qc, kc, vc, gc;
  if (keep) {
    states = torch::empty({NC, N * H, K, V}, opts);
    qc = torch::empty({NC * N * H, C, K}, opts);
    kc = torch::empty({NC * N * H, C, K}, opts);
    vc = torch::empty({NC * N * H, C, V}, opts);
  } else {
    states = qc = kc = vc = torch::empty({0}, opts);
  }
  gc = keep && g.has_value() ? torch::empty({NC * N * H, C}, opts) : torch::empty({0}, opts);
  torch::Tensor h0c = h0.has_value() ? h0->contiguous() : torch::Tensor();
  FiniteCheck finite(check_finite);
  auto run = [&](auto* tag, auto* io_tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using E = std::remove_pointer_t<decltype(io_tag)>;
    Forward<T, E> f;
    static_cast<Grid&>(f) = Grid{N, H, L, K, V, C, NC};
    f.q = rows_of<E>(q, f.q_s);
    f.k = rows_of<E>(k, f.k_s);
    f.v = rows_of<E>(v, f.v_s);
    f.g = rows_of<T>(g, f.g_s);
    f.h0 = data_if<T>(h0.has_value(), h0c);
    f.o = o.data_ptr<E>();
    f.h_out = h_out.data_ptr<T>();
    f.states = data_if<T>(keep, states);
    f.qc = data_if<T>(keep, qc);
    f.kc = data_if<T>(keep, kc);
    f.vc = data_if<T>(keep, vc);
    f.gc = data_if<T>(keep && g.has_value(), gc);
    f.scale = T(scale);
    f.keep = keep;
    f.finite = &finite;
    per_head_group(f);
  };
  if (bf16_io) run(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else fp32_or_fp64(v.scalar_type(), "chunk_linear_attn_fwd", [&](auto* tag) { run(tag, tag); });
  finite.raise_if_any();
  return {o, h_out, states, qc, kc, vc, gc};
}

// Returns (dq, dk, dv [N, NC·C, H, ·], dg [N, NC·C, H] (empty without g), dh0 [N·H, K, V]).
std::vector<torch::Tensor> chunk_linear_attn_bwd(const torch::Tensor& qc, const torch::Tensor& kc,
                                                 const torch::Tensor& vc, const c10::optional<torch::Tensor>& gc,
                                                 const torch::Tensor& states, const torch::Tensor& dout,
                                                 const torch::Tensor& dh_final, double scale, int64_t C) {
  TORCH_CHECK(qc.is_contiguous() && kc.is_contiguous() && vc.is_contiguous() && states.is_contiguous() &&
              (!gc.has_value() || gc->is_contiguous()), "chunk_linear_attn_bwd: the kept tensors must be contiguous");
  TORCH_CHECK(dout.dim() == 4 && dout.stride(3) == 1, "chunk_linear_attn_bwd: do must be [N, H, T, V], unit last stride");
  const int64_t N = dout.size(0), H = dout.size(1), L = dout.size(2), NC = states.size(0);
  const int64_t K = states.size(2), V = states.size(3);
  auto opts = states.options();
  torch::Tensor dq = torch::empty({N, NC * C, H, K}, opts), dk = torch::empty({N, NC * C, H, K}, opts);
  torch::Tensor dv = torch::empty({N, NC * C, H, V}, opts), dh0 = torch::empty({N * H, K, V}, opts);
  torch::Tensor dg = gc.has_value() ? torch::zeros({N, NC * C, H}, opts) : torch::empty({0}, opts);
  torch::Tensor dhf = dh_final.contiguous();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Backward<T> b;
    static_cast<Grid&>(b) = Grid{N, H, L, K, V, C, NC};
    b.qc = qc.data_ptr<T>();
    b.kc = kc.data_ptr<T>();
    b.vc = vc.data_ptr<T>();
    b.gc = gc.has_value() ? gc->data_ptr<T>() : nullptr;
    b.states = states.data_ptr<T>();
    b.dout = rows_of<T>(dout, b.do_s);
    b.dh_final = dhf.data_ptr<T>();
    b.dq = dq.data_ptr<T>();
    b.dk = dk.data_ptr<T>();
    b.dv = dv.data_ptr<T>();
    b.dg = data_if<T>(gc.has_value(), dg);
    b.dh0 = dh0.data_ptr<T>();
    b.scale = T(scale);
    per_head(b);
  };
  fp32_or_fp64(states.scalar_type(), "chunk_linear_attn_bwd", run);
  return {dq, dk, dv, dg, dh0};
}

}  // namespace

void register_chunk_linear_attn(pybind11::module& m) {
  namespace py = pybind11;
  m.def("chunk_linear_attn_fwd", &chunk_linear_attn_fwd, "linear attention's chunk forward, one task per (sequence, head)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("h0"), py::arg("scale"), py::arg("chunk_size"),
        py::arg("keep"), py::arg("check_finite") = "");
  m.def("chunk_linear_attn_bwd", &chunk_linear_attn_bwd, "its backward, last chunk first");
}
