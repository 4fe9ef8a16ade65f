// The (gated) delta rule's chunk forward with bf16 products, on the CPU, one (sequence, head)
// per task (inference: nothing kept for a backward). The products run on whatever gemm_bf16.h's
// ISA path is (AMX, AVX512-BF16, or widened to fp32); the shared pieces are chunk_common.h.
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
// scaled rows), and O = diag(e^b)(Q h) + P U' scales the fp32 rows of Q h (not Q). Then −W and h
// for U' = U − W h, P and U' for O, K̄ and U' for the state's update. Each B operand is packed once
// per chunk (K for S and P, h for U' and O, U' for O and the state), and every product is
// C (+)= A B with no scaling, which the AMX path writes directly: the scale is applied as O is
// rounded to the output (P is kept unscaled, so O accumulates Q h + P U' and is scaled once).
constexpr int64_t kAheadParts = 7;  // the products per chunk, each followed by a part of the next chunk's rows

struct ForwardBf16 {
  using B16 = at::BFloat16;
  const B16 *q, *k, *v;
  const float *beta, *g, *h0;
  int64_t q_s[3] = {}, k_s[3] = {}, v_s[3] = {}, beta_s[3] = {}, g_s[3] = {};
  B16* o;        // [N, NC·C, H, V]
  float* h_out;  // [N·H, K, V]
  int64_t N, H, L, K, V, C, NC;
  float scale;
  FiniteCheck* finite;  // the fused finite check of q, k, v (chunk_common.h)

  int64_t scratch_size() const {  // in floats, exactly what head() takes
    using fastweights::cpu::packed_b_words;
    const int64_t KV = K + V;
    auto f = [](int64_t floats) { return round16(floats); };
    auto b16 = [](int64_t count) { return round16((count + 1) / 2); };
    return b16(C * K) * 2 + b16(C * KV) + b16(C * std::max(C, K)) + b16(C * C) + f(C * KV) + f(C * C) * 3 +
           f(C * V) + f(K * V) + f(C) * 5 + f(packed_b_words(K, C)) + f(packed_b_words(C, KV)) +
           f(packed_b_words(K, V)) + f(packed_b_words(C, V)) * 2;
  }

  void head(int64_t nh, float* scratch) const {
    using fastweights::cpu::gemm_bf16_packed;
    using fastweights::cpu::pack_b;
    using fastweights::cpu::packed_b_words;
    using fastweights::cpu::scale_to_bf16;
    using fastweights::cpu::to_bf16;
    using fastweights::cpu::to_bf16_scaled;
    using fastweights::cpu::to_bf16_times;
    const int64_t n = nh / H, hh = nh % H, KV = K + V;
    float* p = scratch;
    auto take = [&p](int64_t floats) { float* out = p; p += round16(floats); return out; };
    auto take16 = [&take](int64_t count) { return reinterpret_cast<B16*>(take((count + 1) / 2)); };
    auto take32 = [&take](int64_t words) { return reinterpret_cast<uint32_t*>(take(words)); };
    B16* Qh = take16(C * K);             // Q as given
    B16* KVh = take16(C * KV);           // K | V as given
    B16* Kbh = take16(C * K);            // K̄
    B16* Ah = take16(C * std::max(C, K));  // an A operand: T diag(β e^b), then −W, then P
    B16* Tvh = take16(C * C);            // T diag(β) (gated; ungated Ah serves both)
    float* WU = take(C * KV);            // [W | U]
    float* S = take(C * C);
    float* P = take(C * C);
    float* Tm = take(C * C);
    float* O = take(C * V);
    float* h = take(K * V);
    float* Up = WU + K;                  // U', in place of U (leading dimension K + V)
    float* bvec = take(C);
    float* bcum = take(C);
    float* rd = take(C);
    float* te = take(C);
    float* wk = take(C);                           // β e^b (β ungated)
    uint32_t* Kw = take32(packed_b_words(K, C));   // Kᵀ, packed
    uint32_t* Rw = take32(packed_b_words(C, KV));  // K | V (ungated) or K (gated), packed
    uint32_t* Vw = take32(packed_b_words(C, V));   // V (gated), packed
    uint32_t* hw = take32(packed_b_words(K, V));   // h, packed
    uint32_t* Uw = take32(packed_b_words(C, V));   // U', packed
    fastweights::cpu::Workspace ws;

    if (h0 != nullptr) std::memcpy(h, h0 + nh * K * V, sizeof(float) * K * V);
    else std::fill(h, h + K * V, 0.f);
    const auto in = HeadRows<B16, float>::at(n, hh, q, q_s, k, k_s, v, v_s, beta, beta_s, g, g_s, L, K, V, C);
    const bool gated = g != nullptr;
    int64_t bad[3] = {0, 0, 0};
    int64_t* count = finite->on() ? bad : nullptr;

    for (int64_t c = 0; c < NC; ++c) {
      const int64_t t0 = c * C;
      in.gather(t0, Qh, KVh, bvec, bcum, /*prefetch_ahead=*/false, count);
      int64_t part = 0;  // the next chunk's rows are asked for in parts, one after each product
      auto ahead = [&]() { in.prefetch_part(t0 + C, part++, kAheadParts); };
      if (gated) chunk_decays(C, bcum, rd, te);
      // S = K Kᵀ, P = Q Kᵀ (unscaled), masked
      const auto Kt = pack_b(true, K, C, KVh, KV, Kw);
      gemm_bf16_packed(false, C, C, K, 1.f, KVh, KV, Kt, 0.f, S, C, ws);
      ahead();
      gemm_bf16_packed(false, C, C, K, 1.f, Qh, K, Kt, 0.f, P, C, ws);
      ahead();
      mask_scores<float>(C, gated ? bcum : nullptr, S, P, nullptr);
      unit_lower_inverse<float>(C, S, bvec, Tm);
      // [W | U] = T diag(β) [K e^b | V] = [(T diag(β e^b)) K | (T diag(β)) V]
      for (int64_t i = 0; i < C; ++i) wk[i] = gated ? bvec[i] * rd[i] : bvec[i];
      for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, wk, Ah + i * C, C);
      if (gated) {
        for (int64_t i = 0; i < C; ++i) to_bf16_times(Tm + i * C, bvec, Tvh + i * C, C);
        gemm_bf16_packed(false, C, K, C, 1.f, Ah, C, pack_b(false, C, K, KVh, KV, Rw), 0.f, WU, KV, ws);
        gemm_bf16_packed(false, C, V, C, 1.f, Tvh, C, pack_b(false, C, V, KVh + K, KV, Vw), 0.f, WU + K, KV, ws);
      } else {
        gemm_bf16_packed(false, C, KV, C, 1.f, Ah, C, pack_b(false, C, KV, KVh, KV, Rw), 0.f, WU, KV, ws);
      }
      ahead();
      // U' = U + (−W) h
      const auto hp = pack_b(K, V, h, V, hw);
      for (int64_t i = 0; i < C; ++i) to_bf16_scaled(WU + i * KV, -1.f, Ah + i * K, K);
      gemm_bf16_packed(false, C, V, K, 1.f, Ah, K, hp, 1.f, Up, KV, ws);
      ahead();
      const auto Upk = pack_b(C, V, Up, KV, Uw);
      // O = diag(e^b) (Q h) + P U' (scaled on the way out)
      gemm_bf16_packed(false, C, V, K, 1.f, Qh, K, hp, 0.f, O, V, ws);
      if (gated) {
        for (int64_t i = 0; i < C; ++i) {
          const float r = rd[i];
          float* row = O + i * V;
#pragma omp simd
          for (int64_t j = 0; j < V; ++j) row[j] *= r;
          scale_to_bf16(KVh + i * KV, te[i], Kbh + i * K, K);
        }
      }
      ahead();
      to_bf16(P, Ah, C * C);
      gemm_bf16_packed(false, C, V, C, 1.f, Ah, C, Upk, 1.f, O, V, ws);
      ahead();
      // h ← e^{b_C} h + K̄ᵀ U'
      if (gated) {
        const float last = rd[C - 1];
        for (int64_t i = 0; i < K * V; ++i) h[i] *= last;
      }
      gemm_bf16_packed(true, K, V, C, 1.f, gated ? Kbh : KVh, gated ? K : KV, Upk, 1.f, h, V, ws);
      ahead();
      for (int64_t i = 0; i < C; ++i)
        fastweights::cpu::to_bf16_scaled_stream(O + i * V, scale, o + ((n * NC * C + t0 + i) * H + hh) * V, V);
    }
    fastweights::cpu::store_fence();
    fastweights::cpu::gemm_bf16_release();
    std::memcpy(h_out + nh * K * V, h, sizeof(float) * K * V);
    if (count != nullptr) finite->add(count);
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
  per_head(f);
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
