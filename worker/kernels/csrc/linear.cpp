// y = x Wᵀ (+ b) (+ residual) for few rows (decode), fp32 CPU, over a weight packed once at load.
//
// Decode is a matrix-vector problem: each step streams every weight once and does two flops per
// weight per row, so it runs at the speed the weights are read. A GEMM library's row-vector path
// reads a row-major W at well under the read bandwidth; this kernel reads a layout made for it.
//
// Packed layout (`pack_linear`): W [N, K] cut into panels of kPanel = 16 output rows, each stored
// k-major: panel p is [K, 16] with element (k, j) = W[16 p + j, k] (rows past N are zero). A panel
// is one contiguous run of memory, 64 bytes (one cache line, two AVX registers) per k, 2 MiB
// aligned on huge pages. The panels are split into one contiguous range per thread, and each
// thread reads its range as a few streams side by side (see `streams_for`), once per call.
//
// For M rows (2..~32) every panel is read from memory once for all of them: the rows are taken
// up to kMaxRows at a time against the panel, which stays in L1/L2 between those passes. Each
// output is a plain k-ordered fp32 sum of products (fused multiply-add), so it differs from a
// GEMM library's result only by rounding order.
//
// Fused around the GEMV, because at batch 1 every separate op costs about as much as a small
// GEMV: the input RMSNorm (x normalised row by row before the panels are read) and, for the MLP's
// gate/up weight packed with its rows interleaved 8 gate / 8 up, silu(gate) * up in the epilogue
// (each panel yields 8 finished outputs); bias and the residual add are epilogues too.
//
// Built with the other native kernels by worker/kernels/native.py; without AVX2 + FMA the same
// loops run as plain C++ (native.py then keeps the torch path, see `linear_vectorized`).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <sys/mman.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVMESH_AVX2 1
#endif

namespace {

constexpr int64_t kPanel = 16;  // output rows per panel: two 8-float AVX registers
constexpr int kMaxRows = 6;     // x rows per pass over a panel: 12 accumulators + 2 weights + 1 broadcast
constexpr int kMaxStreams = 4;  // panels read side by side (separate memory streams) for one x row

// Panels read side by side for M rows. One sequential stream per thread reads W at well under
// the read bandwidth (the hardware prefetcher runs only so far ahead of one stream); a few
// streams per thread keep more reads in flight. Measured on a 2-core Zen 3 (SmolLM2's lm_head,
// one thread): 1 stream ~17 GB/s, 3-6 streams ~20-25 GB/s. Every stream uses 2 accumulators per
// row, so streams x rows stays within kMaxRows.
inline int streams_for(int64_t M) { return M == 1 ? 4 : M == 2 ? 3 : M <= 6 ? 2 : 1; }

#ifdef KVMESH_AVX2
// R rows of x against S panels: acc[s][r][:] = sum_k x[r, k] * panel_s[k, :]. The two weight
// registers of each panel and k are loaded once and used by every row.
template <int S, int R>
void rows_panels(const float* x, int64_t ldx, const float* const* ws, int64_t K, const float* const* pf, float* acc) {
  __m256 a[S][R][2];
  const float* w[S];
  for (int s = 0; s < S; ++s) {
    w[s] = ws[s];
    for (int r = 0; r < R; ++r) a[s][r][0] = a[s][r][1] = _mm256_setzero_ps();
  }
  // 2 S R accumulators + 2 weights + 1 broadcast <= 15 of the 16 AVX registers: each x value is
  // broadcast right before its two FMAs (a load; holding R broadcasts would spill)
  for (int64_t k = 0; k < K; ++k) {
    if (pf != nullptr)  // one line per k: the whole next panel of each stream over this pass
      for (int s = 0; s < S; ++s) _mm_prefetch(reinterpret_cast<const char*>(pf[s] + k * kPanel), _MM_HINT_T1);
    for (int s = 0; s < S; ++s) {
      const __m256 w0 = _mm256_load_ps(w[s]), w1 = _mm256_load_ps(w[s] + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
        a[s][r][0] = _mm256_fmadd_ps(xr, w0, a[s][r][0]);
        a[s][r][1] = _mm256_fmadd_ps(xr, w1, a[s][r][1]);
      }
      w[s] += kPanel;
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + (s * R + r) * kPanel, a[s][r][0]);
      _mm256_storeu_ps(acc + (s * R + r) * kPanel + 8, a[s][r][1]);
    }
}
#endif

// the same in plain C++ (no AVX2 + FMA)
void rows_panels_plain(const float* x, int64_t ldx, const float* const* ws, int64_t K, int S, int R, float* acc) {
  std::fill(acc, acc + S * R * kPanel, 0.f);
  for (int s = 0; s < S; ++s)
    for (int64_t k = 0; k < K; ++k)
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < kPanel; ++j) acc[(s * R + r) * kPanel + j] += x[r * ldx + k] * ws[s][k * kPanel + j];
}

void rows_against_panels(const float* x, int64_t ldx, const float* const* ws, int64_t K, int S, int R,
                         const float* const* pf, float* acc) {
#ifdef KVMESH_AVX2
  switch (S * 8 + R) {
    case 4 * 8 + 1: return rows_panels<4, 1>(x, ldx, ws, K, pf, acc);
    case 3 * 8 + 2: return rows_panels<3, 2>(x, ldx, ws, K, pf, acc);
    case 3 * 8 + 1: return rows_panels<3, 1>(x, ldx, ws, K, pf, acc);
    case 2 * 8 + 1: return rows_panels<2, 1>(x, ldx, ws, K, pf, acc);
    case 2 * 8 + 2: return rows_panels<2, 2>(x, ldx, ws, K, pf, acc);
    case 2 * 8 + 3: return rows_panels<2, 3>(x, ldx, ws, K, pf, acc);
    case 1 * 8 + 1: return rows_panels<1, 1>(x, ldx, ws, K, pf, acc);
    case 1 * 8 + 2: return rows_panels<1, 2>(x, ldx, ws, K, pf, acc);
    case 1 * 8 + 3: return rows_panels<1, 3>(x, ldx, ws, K, pf, acc);
    case 1 * 8 + 4: return rows_panels<1, 4>(x, ldx, ws, K, pf, acc);
    case 1 * 8 + 5: return rows_panels<1, 5>(x, ldx, ws, K, pf, acc);
    case 1 * 8 + 6: return rows_panels<1, 6>(x, ldx, ws, K, pf, acc);
    default: break;
  }
#endif
  rows_panels_plain(x, ldx, ws, K, S, R, acc);
}

// silu(g) * u = g / (1 + e^-g) * u, for the 8 gate / up channels of a gated panel
#ifdef KVMESH_AVX2
// e^x, x clamped to [-87, 88] (beyond: 0 or inf within float, and silu needs neither): x = n ln2
// + r, e^r by a degree-6 polynomial (Cephes expf coefficients), 2^n through the exponent bits.
// Relative error ~1e-7.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
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

inline void silu_mul8(const float* g, const float* u, float* out) {
  const __m256 gv = _mm256_loadu_ps(g);
  const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), _mm256_loadu_ps(u)));
}
#else
inline void silu_mul8(const float* g, const float* u, float* out) {
  for (int j = 0; j < 8; ++j) out[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
}
#endif

struct Problem {
  const float* x;         // [M, K], row stride ldx
  int64_t ldx, M, K, N;   // N: rows of W (for a gated weight, 2 x the output columns)
  const float* w;         // packed [P, K, 16]
  int64_t P;
  const float* bias;      // [N] or null
  const float* residual;  // [M, N] with row stride ldr, or null
  int64_t ldr;
  bool gated;             // W's rows interleaved 8 gate, 8 up: out = silu(gate) * up, [M, N / 2]
  float* out;             // [M, N] (gated: [M, N / 2]) contiguous
};

// out[r, n0 + j] = residual[r, n0 + j] + (acc[r, j] + bias[n0 + j]) for rows m0 .. m0 + R - 1;
// gated: out[r, 8 panel + j] = silu(gate_j) * up_j, with gate_j = acc[r, j] + bias[n0 + j] and
// up_j = acc[r, 8 + j] + bias[n0 + 8 + j]
void store(const Problem& pr, float* acc, int R, int64_t m0, int64_t panel) {
  const int64_t n0 = panel * kPanel, cols = std::min(kPanel, pr.N - n0);
  if (pr.gated) {
    for (int r = 0; r < R; ++r) {
      float* a = acc + r * kPanel;
      if (pr.bias)
        for (int64_t j = 0; j < kPanel; ++j) a[j] += pr.bias[n0 + j];
      silu_mul8(a, a + 8, pr.out + (m0 + r) * (pr.N / 2) + panel * 8);
    }
    return;
  }
  for (int r = 0; r < R; ++r) {
    const float* a = acc + r * kPanel;
    float* o = pr.out + (m0 + r) * pr.N + n0;
    const float* res = pr.residual ? pr.residual + (m0 + r) * pr.ldr + n0 : nullptr;
    for (int64_t j = 0; j < cols; ++j) {
      const float v = pr.bias ? a[j] + pr.bias[n0 + j] : a[j];
      o[j] = res ? res[j] + v : v;
    }
  }
}

// every row against panels first, first + step, ..., first + (S - 1) step
void run_panels(const Problem& pr, int64_t first, int64_t step, int S) {
  alignas(32) float acc[kMaxRows * kPanel];  // S * R <= kMaxRows
  const float* ws[kMaxStreams];
  const float* next[kMaxStreams];
  bool has_next = true;
  for (int s = 0; s < S; ++s) {
    ws[s] = pr.w + (first + s * step) * pr.K * kPanel;
    next[s] = ws[s] + pr.K * kPanel;
    has_next = has_next && first + s * step + 1 < pr.P;
  }
  // rows in passes of at most kMaxRows / S, as even as possible: a pass of 1-2 rows has too few
  // accumulators to hide the FMA latency (M = 8 runs 4 + 4, not 6 + 2)
  const int64_t passes = (pr.M + kMaxRows / S - 1) / (kMaxRows / S);
  for (int64_t pass = 0, m0 = 0; pass < passes; ++pass) {
    const int R = static_cast<int>((pr.M - m0 + (passes - pass) - 1) / (passes - pass));
    // one stream (7+ rows, compute-bound): while the passes run, pull the next panel into L2 (every
    // pass issues it; after the first they hit), so its memory reads overlap these FMAs. Measured,
    // 2 threads, lm_head: 8 rows 70 -> 85, 12-16 rows 110 -> 125-130 GFLOP/s; with two streams
    // (4-6 rows) prefetching was slower, so only here
    const float* const* pf = S == 1 && has_next ? next : nullptr;
    rows_against_panels(pr.x + m0 * pr.ldx, pr.ldx, ws, pr.K, S, R, pf, acc);
    for (int s = 0; s < S; ++s) store(pr, acc + s * R * kPanel, R, m0, first + s * step);
    m0 += R;
  }
}

// Packed weights are allocated 2 MiB-aligned and marked for transparent huge pages: the
// kernel streams hundreds of MB, and with 4 KiB pages the TLB misses cost ~20% of the read
// speed (measured, SmolLM2's lm_head). Where the kernel does not honour the advice, the memory
// is ordinary pages.
torch::Tensor empty_huge(at::IntArrayRef sizes) {
  constexpr size_t kHuge = size_t(1) << 21;
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = std::max<size_t>(kHuge, (numel * sizeof(float) + kHuge - 1) / kHuge * kHuge);
  void* ptr = std::aligned_alloc(kHuge, bytes);
  TORCH_CHECK(ptr != nullptr, "pack_linear: cannot allocate ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(ptr, bytes, MADV_HUGEPAGE);  // advice only: failing it leaves ordinary pages
#endif
  return torch::from_blob(ptr, sizes, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

// W [N, K] fp32 -> packed [ceil(N / 16), K, 16] (see the layout above)
torch::Tensor pack_linear(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear: a 2-d fp32 CPU weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(N > 0 && K > 0, "pack_linear: an empty weight");
  auto padded = at::constant_pad_nd(weight, {0, 0, 0, P * kPanel - N});  // [P * 16, K]
  auto packed = empty_huge({P, K, kPanel});
  packed.copy_(padded.view({P, kPanel, K}).transpose(1, 2));              // [P, K, 16]
  return packed;
}

namespace {

// h = weight * (x * rsqrt(mean(x²) + eps)) row by row (HF LlamaRMSNorm's order of operations), [M, K]
torch::Tensor rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.device().is_cpu(), "rms_norm: norm weight [K] fp32");
  const auto w = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  auto h = torch::empty({M, K}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {  // serial up to 64 rows (decode)
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = xp + m * ldx;
      float* hr = hp + m * K;
      int64_t k = 0;
      float ss = 0.f;
#ifdef KVMESH_AVX2
      __m256 acc = _mm256_setzero_ps();
      for (; k + 8 <= K; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + k), _mm256_loadu_ps(xr + k), acc);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc);
      for (const float l : lanes) ss += l;
#endif
      for (; k < K; ++k) ss += xr[k] * xr[k];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + static_cast<float>(eps));
      for (k = 0; k < K; ++k) hr[k] = wp[k] * (xr[k] * inv);
    }
  });
  return h;
}

}  // namespace

// the norm for qlinear.cpp's fused prologue
torch::Tensor kvmesh_rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  return rms_norm_rows(x, weight, eps);
}

namespace {

// y [M, 2 I] = [gate | up] -> silu(gate) * up [M, I] (the MLP between a wide GEMM and down_proj)
torch::Tensor silu_mul_rows(const torch::Tensor& y) {
  TORCH_CHECK(y.dim() == 2 && y.size(1) % 2 == 0 && y.scalar_type() == at::kFloat && y.device().is_cpu(),
              "silu_mul: y [M, 2 I] fp32 CPU");
  const auto yc = y.stride(1) == 1 ? y : y.contiguous();
  const int64_t M = yc.size(0), I = yc.size(1) / 2, ldy = yc.stride(0);
  auto out = torch::empty({M, I}, yc.options());
  const float* yp = yc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* g = yp + m * ldy;
      float* o = op + m * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) silu_mul8(g + i, g + I + i, o + i);
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[I + i];
    }
  });
  return out;
}

}  // namespace

// x [M, K] against packed [P, K, 16] of a weight with N rows -> [M, N] = residual + (x Wᵀ + bias).
// Optional: bias [N]; residual [M, N]; norm_weight [K]: x is first RMS-normalised row by row
// (weight * x * rsqrt(mean(x²) + eps)); gated: W's rows are interleaved 8 gate, 8 up (see
// worker.model.GatedLinear) and the result is silu(gate) * up, [M, N / 2] (no residual).
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                            c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> norm_weight,
                            double eps, bool gated) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanel,
              "packed_linear: x [M, K], packed [P, K, 16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  packed.device().is_cpu(), "packed_linear: fp32 CPU tensors");
  TORCH_CHECK(packed.is_contiguous() && reinterpret_cast<uintptr_t>(packed.data_ptr()) % 32 == 0,
              "packed_linear: a contiguous, 32-byte aligned packed weight (from pack_linear)");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && N > (P - 1) * kPanel && N <= P * kPanel, "packed_linear: shapes");
  TORCH_CHECK(!gated || (N % kPanel == 0 && !residual), "packed_linear: a gated weight has 16k rows and no residual");
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  if (norm_weight) xc = rms_norm_rows(xc, *norm_weight, eps);
  torch::Tensor b, res;
  if (bias) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N && b.device().is_cpu(), "packed_linear: bias [N] fp32");
  }
  if (residual) {
    res = residual->stride(-1) == 1 ? *residual : residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.dim() == 2 && res.size(0) == M && res.size(1) == N &&
                    res.device().is_cpu(), "packed_linear: residual [M, N] fp32");
  }
  auto out = torch::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0) return out;
  const Problem pr{xc.data_ptr<float>(), xc.stride(0), M, K, N, packed.data_ptr<float>(), P,
                   bias ? b.data_ptr<float>() : nullptr, residual ? res.data_ptr<float>() : nullptr,
                   residual ? res.stride(0) : 0, gated, out.data_ptr<float>()};
  const int S = streams_for(M);
  // one contiguous range of panels per thread, read as S streams side by side
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), P));
  at::parallel_for(0, P, (P + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    const int64_t len = (end - begin) / S;
    for (int64_t i = 0; i < len; ++i) run_panels(pr, begin + i, len, S);
    for (int64_t p = begin + len * S; p < end; ++p) run_panels(pr, p, 0, 1);
  });
  return out;
}

void bind_linear(pybind11::module& m) {
  m.def("pack_linear", &pack_linear, "pack an fp32 weight [N, K] into 16-row panels for packed_linear");
  m.def("packed_linear", &packed_linear, "residual + (x Wᵀ + bias) over a packed weight (CPU, few rows)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("residual") = pybind11::none(), pybind11::arg("norm_weight") = pybind11::none(),
        pybind11::arg("eps") = 1e-6, pybind11::arg("gated") = false);
  m.def("rms_norm", [](torch::Tensor x, torch::Tensor weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "rms_norm: x [M, K] fp32 CPU");
    return rms_norm_rows(x.stride(1) == 1 ? x : x.contiguous(), weight, eps);
  }, "weight * (x * rsqrt(mean(x²) + eps)) row by row (CPU fp32)");
  m.def("silu_mul", &silu_mul_rows, "[gate | up] [M, 2 I] -> silu(gate) * up [M, I] (CPU fp32)");
  m.attr("linear_panel") = kPanel;
#ifdef KVMESH_AVX2
  m.attr("linear_vectorized") = true;
#else
  m.attr("linear_vectorized") = false;
#endif
}
