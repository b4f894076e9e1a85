// Decode attention read in place from the paged KV cache (fp32, CPU).
//
// One query token per sequence. Each sequence is one work item: its Hq query rows are scored
// against its keys slot by slot (a slot holds all kv heads, Hkv * D contiguous floats, so the
// reads stream through each block), softmax runs in fp32 per query head, then one pass over
// the V slots accumulates the output. Nothing is gathered: the torch path copies every block a
// step reads into a dense tensor and reads it again in SDPA; this kernel reads each cached
// byte once.
//
// Built at run time by worker/kernels/native.py (torch.utils.cpp_extension); the Python side
// checks dtypes, devices and shapes before calling and falls back to the torch path for what
// this kernel does not cover (quantized caches, score collection, GPU). With AVX2 + FMA the
// inner loops are vectorised when head_dim is a multiple of 8; otherwise plain C++ loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVMESH_AVX2 1
#endif

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per kv head

#ifdef KVMESH_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (softmax after subtracting the max): x = n ln2 + r, |r| <= ln2 / 2, e^r by a
// degree-6 polynomial (Cephes expf coefficients), 2^n through the exponent bits. Relative
// error ~1e-7 (tested against torch.softmax through the whole kernel).
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below: 0 up to ~1e-38, and 2^n stays normal
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

// s[g * ld] = dot(q + g * D, k) for g < G
template <int G>
inline void dots(const float* q, const float* k, int64_t D, float* s, int64_t ld) {
#ifdef KVMESH_AVX2
  if (D % 8 == 0) {
    __m256 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 kv = _mm256_loadu_ps(k + d);
      for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
    }
    for (int g = 0; g < G; ++g) s[g * ld] = hsum(acc[g]);
    return;
  }
#endif
  for (int g = 0; g < G; ++g) {
    float a = 0.f;
    for (int64_t d = 0; d < D; ++d) a += q[g * D + d] * k[d];
    s[g * ld] = a;
  }
}

// scale, subtract the max, exponentiate in place; returns the sum
inline float softmax_numerators(float* s, int64_t n, float scale) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  m *= scale;  // scale > 0
  int64_t t = 0;
  float sum = 0.f;
#ifdef KVMESH_AVX2
  __m256 vsum = _mm256_setzero_ps();
  const __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpos(_mm256_fmsub_ps(_mm256_loadu_ps(s + t), vs, vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  sum = hsum(vsum);
#endif
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] * scale - m);
    sum += s[t];
  }
  return sum;
}

// out[g * D + d] += sum over the n slots v_i = v + i * stride of p[g * ld + i] * v_i[d], for g < G
template <int G>
inline void weighted_rows(const float* p, int64_t ld, const float* v, int64_t stride, int64_t n, int64_t D,
                          float* out) {
#ifdef KVMESH_AVX2
  if (D % 8 == 0) {
    for (int64_t d = 0; d < D; d += 8) {
      __m256 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
      for (int64_t i = 0; i < n; ++i) {
        const __m256 vv = _mm256_loadu_ps(v + i * stride + d);
        for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g * ld + i]), vv, acc[g]);
      }
      for (int g = 0; g < G; ++g) {
        float* o = out + g * D + d;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), acc[g]));
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i)
    for (int g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) out[g * D + d] += p[g * ld + i] * v[i * stride + d];
}

struct Shape {
  int64_t bs, Hkv, D;
  float scale;
};

struct Scratch {  // per thread, reused across sequences
  std::vector<float> scores, acc, sums;
};

// One sequence: query rows q [Hkv * G, D] over keys start .. L-1 of block table `row`.
// Scores are [Hq, S] (query head-major), the accumulator [Hq, D].
template <int G>
void decode_one(const float* q, const float* kp, const float* vp, const int64_t* row, int64_t start, int64_t L,
                const Shape& sh, Scratch& scratch, float* out) {
  const int64_t bs = sh.bs, Hkv = sh.Hkv, D = sh.D, Hq = Hkv * G, S = L - start, slot = Hkv * D;
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  std::vector<float>& sum = scratch.sums;
  scores.resize(Hq * S);
  sum.resize(Hq);
  for (int64_t t = start; t < L;) {  // K pass, block by block
    const int64_t j = t / bs, off = t % bs, stop = std::min(L, (j + 1) * bs);
    const float* k = kp + (row[j] * bs + off) * slot;
    for (; t < stop; ++t, k += slot)
      for (int64_t h = 0; h < Hkv; ++h) dots<G>(q + h * G * D, k + h * D, D, scores.data() + h * G * S + (t - start), S);
  }
  for (int64_t i = 0; i < Hq; ++i) sum[i] = softmax_numerators(scores.data() + i * S, S, sh.scale);
  acc.assign(Hq * D, 0.f);
  for (int64_t t = start; t < L;) {  // V pass, block by block
    const int64_t j = t / bs, off = t % bs, n = std::min(L, (j + 1) * bs) - t;
    const float* v = vp + (row[j] * bs + off) * slot;
    for (int64_t h = 0; h < Hkv; ++h)
      weighted_rows<G>(scores.data() + h * G * S + (t - start), S, v + h * D, slot, n, D, acc.data() + h * G * D);
    t += n;
  }
  for (int64_t i = 0; i < Hq; ++i) {
    const float inv = 1.f / sum[i];
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = acc[i * D + d] * inv;
  }
}

using DecodeFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, const Shape&,
                          Scratch&, float*);

template <int G>
DecodeFn pick(int64_t g) {
  if constexpr (G > kMaxGroup) {
    return nullptr;
  } else {
    return g == G ? &decode_one<G> : pick<G + 1>(g);
  }
}

void check_caches(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "paged_decode: caches [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "paged_decode: CPU tensors");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat, "paged_decode: fp32 only");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode: int64 block tables and lengths");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  TORCH_CHECK(scale > 0, "paged_decode: scale must be positive");
}

// Attention of query rows q [B, Hq, D] (contiguous) over the caches (checked by check_caches);
// see paged_decode below for the arguments.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens, double scale, int64_t window) {
  const auto tables = block_tables.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "paged_decode: head shapes");
  const DecodeFn fn = pick<1>(Hq / Hkv);
  TORCH_CHECK(fn != nullptr, "paged_decode: at most ", kMaxGroup, " query heads per kv head");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lens.dim() == 1 && lens.size(0) == B,
              "paged_decode: one block table row and length per query row");
  const int64_t max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> starts(B), cum(B + 1, 0);  // cum[b]: keys read by rows < b
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * bs, "paged_decode: seq_len out of range");
    starts[b] = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0;
    for (int64_t j = starts[b] / bs; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * max_blocks + j] >= 0 && tp[b * max_blocks + j] < num_blocks,
                  "paged_decode: block id out of range");
    cum[b + 1] = cum[b] + lp[b] - starts[b];
  }
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Shape sh{bs, Hkv, D, static_cast<float>(scale)};
  // rows cut into one contiguous range per thread holding about the same number of keys
  // (one row runs inline: at::parallel_for starts no threads for a range of 1)
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B));
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t part = begin; part < end; ++part) {
      const int64_t lo = std::lower_bound(cum.begin(), cum.end(), cum[B] * part / parts) - cum.begin();
      const int64_t hi = std::lower_bound(cum.begin(), cum.end(), cum[B] * (part + 1) / parts) - cum.begin();
      for (int64_t b = lo; b < std::min(hi, B); ++b)
        fn(qp + b * Hq * D, kp, vp, tp + b * max_blocks, starts[b], lp[b], sh, scratch, op + b * Hq * D);
    }
  });
  return out;
}

// RoPE of one head, out = x * cos + (x2, x1) * sin_signed, as worker.model.Rotary.apply computes
// it: both products rounded, then their sum (the extension is built with -ffp-contract=off, so
// the compiler fuses neither into an FMA) -- bit for bit torch's result, which HF's equals.
inline void rope_head(const float* x, const float* cos, const float* sin_signed, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * cos[d] + x[d + half] * sin_signed[d];
  for (int64_t d = half; d < D; ++d) out[d] = x[d] * cos[d] + x[d - half] * sin_signed[d];
}

}  // namespace

// query [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
// int64; seq_lens [B] int64 (keys 0 .. L-1 are read); window > 0 reads only the last `window`
// keys (L - window .. L - 1). Returns [B, Hq, D].
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && query.device().is_cpu(), "paged_decode: query [B, Hq, D] on CPU");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "paged_decode: fp32 only");
  check_caches(k_cache, v_cache, block_tables, seq_lens, scale);
  return attend(query.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale, window);
}

// A decode step's attention for one layer in one call: RoPE of q and k, k and v written to their
// cache slots, then paged_decode of the rotated queries (what worker.model.DecoderLayer runs as
// Rotary.apply, reference.write_kv and paged_attention, without the ops between them).
// qkv [B, >= (Hq + 2 Hkv) D] (unit column stride): each token's q | k | v heads before RoPE;
// cos, sin_signed [B, 1, D] or [B, D]: the RoPE rows of each token's position (Rotary.tables);
// slot_mapping [B] int64: each token's cache slot; the rest as paged_decode. Every k/v row is
// written before any row attends, as write_kv then paged_attention do. Returns [B, Hq * D].
torch::Tensor rope_paged_decode(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed,
                                torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping,
                                torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window,
                                int64_t num_heads) {
  check_caches(k_cache, v_cache, block_tables, seq_lens, scale);
  const int64_t B = qkv.size(0), Hq = num_heads, Hkv = k_cache.size(2), D = k_cache.size(3);
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 &&
                  qkv.size(1) >= (Hq + 2 * Hkv) * D, "rope_paged_decode: qkv [B, (Hq + 2 Hkv) D] fp32 CPU");
  TORCH_CHECK(Hq > 0 && D % 2 == 0, "rope_paged_decode: num_heads > 0 and an even head_dim");
  const auto c = cos.reshape({B, D}).contiguous(), s = sin_signed.reshape({B, D}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat && c.device().is_cpu() &&
                  s.device().is_cpu(), "rope_paged_decode: cos, sin_signed [B, D] fp32 CPU");
  const auto sm = slot_mapping.contiguous();
  TORCH_CHECK(sm.scalar_type() == at::kLong && sm.dim() == 1 && sm.size(0) == B,
              "rope_paged_decode: slot_mapping [B] int64");
  const int64_t* smp = sm.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(smp[b] >= 0 && smp[b] < slots, "rope_paged_decode: slot out of range");
  auto q = torch::empty({B, Hq, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k_cache.data_ptr<float>();
  float* vp = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {  // a few KB per token: serial
    const float* x = xp + b * qkv.stride(0);
    const float* cb = cp + b * D;
    const float* sb = sp + b * D;
    for (int64_t h = 0; h < Hq; ++h) rope_head(x + h * D, cb, sb, D, qp + (b * Hq + h) * D);
    for (int64_t h = 0; h < Hkv; ++h) rope_head(x + (Hq + h) * D, cb, sb, D, kp + (smp[b] * Hkv + h) * D);
    std::copy(x + (Hq + Hkv) * D, x + (Hq + 2 * Hkv) * D, vp + smp[b] * Hkv * D);
  }
  return attend(q, k_cache, v_cache, block_tables, seq_lens, scale, window).view({B, Hq * D});
}

void bind_linear(pybind11::module& m);  // csrc/linear.cpp: the packed-weight linear kernels
void bind_qlinear(pybind11::module& m);  // csrc/qlinear.cpp: the Q8 / Q4 / bf16 panel kernels
void bind_block_copy(pybind11::module& m);  // csrc/block_copy.cpp: KV blocks between the pool and the host tier

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_linear(m);
  bind_qlinear(m);
  bind_block_copy(m);
  m.def("paged_decode", &paged_decode, "decode attention over a paged fp32 KV cache (CPU)");
  m.def("rope_paged_decode", &rope_paged_decode, "RoPE, KV write and decode attention of one layer (CPU fp32)");
  m.attr("max_group") = kMaxGroup;
}
