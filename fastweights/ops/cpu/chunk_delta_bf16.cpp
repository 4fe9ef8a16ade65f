// The (gated) delta rule's chunk forward with bf16 products, on the CPU, one (sequence, head)
// per task, a thread's tasks worked on in groups chunk by chunk (inference: nothing kept for a
// backward). The products run on whatever gemm_bf16.h's ISA path is (AMX, AVX512-BF16, or
// widened to fp32); the shared pieces are chunk_common.h and chunk_bf16.h.
#include "chunk_bf16.h"

namespace {

using namespace fastweights::cpu::chunk;
using fastweights::cpu::round16;

// The forward with bf16 products (inference: nothing kept for a backward). Every product takes
// bf16 operands and accumulates in fp32 (gemm_bf16.h: AMX tiles or AVX512-BF16's dot-product
// instruction where the CPU has them); the state, the decays, the triangular solve for T and every
// sum stay fp32, and an operand is rounded to bf16 once, right before its first product. The
// inputs' own bf16 rows serve as they are (no scaled copy of Q, K or V is rounded).
//
// The gate. With D = diag(e^b) (b the chunk's cumulative log decay) the gated chunk's matrices are
// the ungated ones conjugated by D: S = D S₀ D⁻¹ and P = D P₀ D⁻¹ (S₀, P₀ the masked K Kᵀ, Q Kᵀ),
// so T = (I + diag(β) S)⁻¹ = D T₀ D⁻¹ with T₀ = (I + diag(β) S₀)⁻¹, and every gated product is an
// ungated one with its rows rescaled:
//   W = D T₀ diag(β) K,   U = D T₀ diag(β e^{−b}) V,   U' = U − W h = D Ũ',
//   O = D (Q h + P₀ Ũ'),  h_next = e^{b_C} (h + Kᵀ Ũ'),
// with Ũ' = T₀ diag(β e^{−b}) V − (T₀ diag(β) K) h. Each matrix differs from its directly decayed
// counterpart by a row or column scaling only, so every rounding and every sum sees the same
// relative sizes (floating point is scale-free); what changes is that no C×C decay matrix is formed
// (no exponential per pair), K is used as given (no rounded copy of K̄ = diag(e^{b_C − b}) K), D is
// applied as O is stored and e^{b_C} as the state is next packed. The factors e^{±b} must stay in
// fp32's range: a chunk with some |b| > kFactorBound is worked on directly instead, with
// Γ = exp(b_i − b_j) in S and P, [W | U] = (T diag(β e^b)) K | (T diag(β)) V, O = D (Q h) + P U'
// and K̄ rounded as it is transposed.
//
// Every call costs the product's dispatch, so products that share their B operand run as one call
// on stacked A rows (one leading dimension; the scratch keeps −W, Q and K | V in consecutive rows,
// and [−W h; O; h] likewise), each C (+)= A B with no scaling (what the AMX path writes directly):
//   [P; S]    = [Q; K] Kᵀ                (P unscaled)
//   [W | U]   = A_W K | A_U V            (one call [W | U] where ungated, A_W = A_U = T diag(β))
//   [−W h; O] = [−W; Q] h                (U' = U + (−W h) is formed as it is packed)
//   [O; h]   += [P; Kᵀ] U'               (h's decay, where gated, applied as it was packed)
// The attention scale is applied as O is rounded to the output (P is kept unscaled, so O
// accumulates Q h + P U' and is scaled once, by scale · e^{b_i} where the gate was factored).
constexpr int64_t kAheadParts = 5;  // the next chunk's rows are asked for in parts, one after each product
constexpr float kFactorBound = 60.f;  // |b| ≤ this in a chunk: e^{±b} and their products with the rows stay finite

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
    const int64_t KV = K + V, ldt = transposed_ld(C);
    auto b16 = ScratchPlan::bf16s;
    Layout s{};
    ScratchPlan plan;
    plan.put(s.R, b16(3 * C * KV));                  // rows [−W; Q; K | V], ld K + V
    plan.put(s.Ah, b16(C * C));                      // T diag(β e^b) (ungated: T diag(β))
    plan.put(s.Tb, b16(C * C));                      // T diag(β) (gated)
    plan.put(s.PK, b16((C + K) * ldt));              // [P; K̄ᵀ], ld transposed_ld(C)
    plan.put(s.tmp, b16(C * K) + (C + 1) / 2 * round16(K));  // transpose_keys' scratch
    plan.put(s.Kw, packed_b_words(K, C));            // Kᵀ, packed
    plan.put(s.Rw, packed_b_words(C, KV));           // K | V (ungated) or K (gated), packed
    plan.put(s.Vw, packed_b_words(C, V));            // V (gated), packed
    plan.put(s.hw, packed_b_words(K, V));            // h, packed
    plan.put(s.Uw, packed_b_words(C, V));            // U', packed
    plan.put(s.SP, 2 * C * C);                       // [P; S]
    plan.put(s.Tm, C * C);                           // T
    plan.put(s.WU, C * KV);                          // [W | U]
    plan.put(s.vec, 5 * round16(C));                 // β, b, e^b, e^{−b} or e^{b_C − b}, the factor of A_W or A_U
    s.X = plan.at;                                   // per head of a group: [−W h; O; h], ld V
    s.total = plan.at + group() * x_floats();
    return s;
  }
  int64_t scratch_size() const { return layout().total; }
  int64_t x_floats() const { return head_rows_floats(C, K, V); }
  int64_t group() const { return head_group(C, K, V); }  // heads worked on side by side (chunk_bf16.h)

  // Tasks begin .. end (sequence·H + head), in groups of group() heads, chunk by chunk.
  void run(int64_t begin, int64_t end, float* scratch) const {
    const Layout s = layout();
    const int64_t G = group();
    fastweights::cpu::Workspace ws;
    HeadRows<B16, float> in[kMaxGroup];
    int64_t bad[kMaxGroup][3];
    float owed[kMaxGroup];  // each head's decay not yet applied to its state (the last factored chunk's e^{b_C})
    for (int64_t first = begin; first < end; first += G) {
      const int64_t heads = std::min(G, end - first);
      for (int64_t j = 0; j < heads; ++j) {
        const int64_t nh = first + j, n = nh / H, hh = nh % H;
        float* h = scratch + s.X + j * x_floats() + 2 * C * V;
        if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(float) * K * V);
        else std::fill(h, h + K * V, 0.f);
        in[j] = HeadRows<B16, float>::at(n, hh, q, q_s, k, k_s, v, v_s, beta, beta_s, g, g_s, L, K, V, C);
        std::fill(bad[j], bad[j] + 3, int64_t(0));
        owed[j] = 1.f;
      }
      for (int64_t c = 0; c < NC; ++c)
        for (int64_t j = 0; j < heads; ++j)
          chunk(first + j, c, in[j], scratch, scratch + s.X + j * x_floats(), owed[j], ws, finite->on() ? bad[j] : nullptr);
      fastweights::cpu::store_fence();
      fastweights::cpu::gemm_bf16_release();
      for (int64_t j = 0; j < heads; ++j) {
        const float* h = scratch + s.X + j * x_floats() + 2 * C * V;
        const float f = owed[j];
        store_state_by(K, V, h, [f](int64_t) { return f; }, f != 1.f, h_out + (first + j) * K * V);
        if (finite->on()) finite->add(bad[j]);
      }
    }
  }

  // Chunk c of head nh: X is the head's own [−W h; O; h] rows (h its state, still owed the decay
  // `owed`, which this chunk applies and replaces with its own where it factors the gate), the rest
  // of the scratch shared; count (nullptr: no check) its non-finite counts of q, k, v.
  void chunk(int64_t nh, int64_t c, const HeadRows<B16, float>& in, float* scratch, float* X, float& owed,
             fastweights::cpu::Workspace& ws, int64_t* count) const {
    const int64_t n = nh / H, hh = nh % H, KV = K + V, ldt = transposed_ld(C);
    const Layout s = layout();
    const ScratchView mem{scratch};
    B16* Wr = mem.b16(s.R);     // −W (columns 0..K)
    B16* Qr = Wr + C * KV;  // Q (columns 0..K)
    B16* KVr = Qr + C * KV; // K | V
    B16* Ah = mem.b16(s.Ah);
    B16* Tb = mem.b16(s.Tb);
    B16* PK = mem.b16(s.PK);
    B16* tmp16 = mem.b16(s.tmp);
    uint32_t* tmpw = mem.w32(s.tmp + round16((C * K + 1) / 2));
    float* P = scratch + s.SP;
    float* S = P + C * C;
    float* Tm = scratch + s.Tm;
    float* WU = scratch + s.WU;
    float* WH = X;  // [−W h; O; h] with one leading dimension V
    float* O = WH + C * V;
    float* h = O + C * V;
    float* bvec = scratch + s.vec;
    float* bcum = bvec + round16(C);
    float* rd = bcum + round16(C);  // e^b
    float* te = rd + round16(C);    // e^{−b} (factored) or e^{b_C − b} (direct)
    float* wk = te + round16(C);    // A_W's or A_U's column factor
    const bool gated = g != nullptr;
    const int64_t t0 = c * C;
    gather(in, t0, Qr, KVr, bvec, bcum, count);
    int64_t part = 0;
    auto ahead = [&]() { in.prefetch_part(t0 + C, part++, kAheadParts); };
    // the gate factored (D outside every product) where e^{±b} stay in range, else applied directly
    bool factored = false;
    if (gated) {
      for (int64_t i = 1; i < C; ++i) bcum[i] += bcum[i - 1];
      factored = true;
      for (int64_t i = 0; i < C; ++i) factored = factored && std::abs(bcum[i]) <= kFactorBound;
      for (int64_t i = 0; i < C; ++i) {
        rd[i] = std::exp(bcum[i]);
        te[i] = std::exp(factored ? -bcum[i] : bcum[C - 1] - bcum[i]);
      }
    }
    const bool direct = gated && !factored;
    // [P; S] = [Q; K] Kᵀ (P unscaled), masked (and decayed where the gate is applied directly)
    gemm_bf16_packed(false, 2 * C, C, K, 1.f, Qr, KV, pack_b(true, K, C, KVr, KV, mem.w32(s.Kw)), 0.f, P, C, ws);
    ahead();
    mask_scores<float>(C, direct ? bcum : nullptr, S, P, nullptr);
    unit_lower_inverse_bf16fwd(C, S, bvec, Tm);
    // [W | U] = A_W K | A_U V: ungated A_W = A_U = T diag(β); factored T₀ diag(β) | T₀ diag(β e^{−b})
    // (W and U without their row factor D); direct (T diag(β e^b)) | (T diag(β))
    if (gated) {
      for (int64_t i = 0; i < C; ++i) wk[i] = factored ? bvec[i] * te[i] : bvec[i] * rd[i];
      const float* fw = factored ? bvec : wk;
      const float* fu = factored ? wk : bvec;
      for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, fw, Ah + i * C, C);
      for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, fu, Tb + i * C, C);
      gemm_bf16_packed(false, C, K, C, 1.f, Ah, C, pack_b(false, C, K, KVr, KV, mem.w32(s.Rw)), 0.f, WU, KV, ws);
      gemm_bf16_packed(false, C, V, C, 1.f, Tb, C, pack_b(false, C, V, KVr + K, KV, mem.w32(s.Vw)), 0.f, WU + K, KV, ws);
    } else {
      for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, bvec, Ah + i * C, C);
      gemm_bf16_packed(false, C, KV, C, 1.f, Ah, C, pack_b(false, C, KV, KVr, KV, mem.w32(s.Rw)), 0.f, WU, KV, ws);
    }
    ahead();
    // [−W h; O] = [−W; Q] h with h the state entering the chunk (its owed decay applied as it is
    // packed; where the gate is applied directly, h ← e^{b_C} h too); U' = U + (−W h)
    const auto hp = pack_state(K, V, h, owed, direct ? rd[C - 1] : 1.f, mem.w32(s.hw));
    owed = factored ? rd[C - 1] : 1.f;
    for (int64_t i = 0; i < C; ++i) to_bf16_scaled<true>(WU + i * KV, -1.f, Wr + i * KV, K);
    gemm_bf16_packed(false, 2 * C, V, K, 1.f, Wr, KV, hp, 0.f, WH, V, ws);
    ahead();
    const auto Upk = pack_sum(C, V, WU + K, KV, WH, V, mem.w32(s.Uw));
    // [O; h] += [P; K̄ᵀ] U' (K̄ = K unless the gate is applied directly), after O ← D O there
    if (direct) scale_rows(C, V, O, rd);
    for (int64_t i = 0; i < C; ++i) to_bf16(P + i * C, PK + i * ldt, C);
    transpose_keys(C, K, KVr, KV, direct ? te : nullptr, PK + C * ldt, ldt, tmp16, tmpw);
    ahead();
    gemm_bf16_packed(false, C + K, V, C, 1.f, PK, ldt, Upk, 1.f, O, V, ws);
    ahead();
    for (int64_t i = 0; i < C; ++i)
      fastweights::cpu::to_bf16_scaled_stream(O + i * V, factored ? scale * rd[i] : scale,
                                              o + ((n * NC * C + t0 + i) * H + hh) * V, V);
  }

  // The chunk at t0 into Qr (q, ld K + V) and KVr (k | v), rows past the end zero; β and g into
  // bvec / bcum; bad (nullptr: no check) counts q's, k's and v's NaN/Inf entries.
  void gather(const HeadRows<B16, float>& in, int64_t t0, B16* Qr, B16* KVr, float* bvec, float* bcum,
              int64_t* bad) const {
    const int64_t rows = std::max<int64_t>(0, std::min(C, L - t0)), KV = K + V;
    gather_qkv_checked(in.q, in.q_t, in.k, in.k_t, in.v, in.v_t, t0, rows, C, K, V, Qr, KV, KVr, KV, KVr + K, KV, bad);
    for (int64_t i = 0; i < C; ++i) {
      const int64_t t = t0 + i;
      bvec[i] = i < rows ? in.beta[t * in.beta_t] : 0.f;
      bcum[i] = i < rows && in.g != nullptr ? in.g[t * in.g_t] : 0.f;
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
