// y = x Wᵀ (+ b) (+ residual) over a weight kept in its own format: GGUF Q8_0 / Q4_0 / Q4_1 or
// bf16, packed once into 16-row panels (layout: worker/model/weights.py). The same fused prologue /
// epilogues as linear.cpp: the input RMSNorm, bias, residual add and, for the interleaved gate/up
// weight, silu(gate) * up.
//
// Q8_0 / Q4_*: x is quantized to int8 once per call, per row and block of 32 columns (scale
// dx = max|x| / 127, codes round(x / dx), as llama.cpp's Q8 activations), and the kernel takes
// integer dot products of those codes with the weight's (qlinear.inc); the fp32 sums apply each
// block's scales once. bf16: widened to fp32 in registers, x and every sum fp32.
//
// Any number of rows: decode reads each panel once for all rows (up to 8 per pass against a
// panel that stays in L1/L2), prefill runs the same loop with more passes (the weight is never
// dequantized to memory). The instruction set is chosen at run time: AVX-512 (F, BW, VL, DQ and
// VNNI) when the CPU has it, else AVX2 + FMA + F16C; `qlinear_isa` says which ("" = neither: the
// caller keeps dequantized fp32 weights).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <sys/mman.h>
#include <immintrin.h>

torch::Tensor kvmesh_rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, double eps);  // linear.cpp

namespace {

constexpr int64_t kPanel = 16, kBlock = 32;
enum Fmt : int { kQ8 = 0, kQ4 = 1, kBF16 = 2 };
constexpr int64_t kRecord[3] = {544, 320, 1024};

struct QProblem {
  const float* x;         // [M, K], row stride ldx
  int64_t ldx, M, K, N;   // N: rows of W (gated: 2 x the outputs)
  const uint8_t* w;       // packed [P, nb, rec]
  int64_t P, nb, rec;
  int fmt;
  const int8_t* xq;       // [M, K] x's int8 codes (Q8 / Q4), else null
  const float* xd;        // [M, nb] their scales per block
  const int32_t* xcorr;   // [M, nb] 128 x the sum of each block's codes (Q8 on AVX-512: its + 128 offset)
  const float* xsum;      // [M, nb] sums of the quantized x over each block (4-bit formats: the offsets' term)
  const float* bias;      // [N] or null
  const float* residual;  // [M, N], row stride ldr, or null
  int64_t ldr;
  bool gated;
  float* out;             // [M, N] (gated [M, N / 2])
};

void store(const QProblem& pr, float* acc, int R, int64_t m0, int64_t panel) {
  const int64_t n0 = panel * kPanel, cols = std::min(kPanel, pr.N - n0);
  for (int r = 0; r < R; ++r) {
    float* a = acc + r * kPanel;
    if (pr.bias)
      for (int64_t j = 0; j < cols; ++j) a[j] += pr.bias[n0 + j];
    if (pr.gated) {
      float* o = pr.out + (m0 + r) * (pr.N / 2) + panel * 8;
      for (int j = 0; j < 8; ++j) o[j] = a[j] / (1.f + std::exp(-a[j])) * a[8 + j];
      continue;
    }
    float* o = pr.out + (m0 + r) * pr.N + n0;
    const float* res = pr.residual ? pr.residual + (m0 + r) * pr.ldr + n0 : nullptr;
    for (int64_t j = 0; j < cols; ++j) o[j] = res ? res[j] + a[j] : a[j];
  }
}

}  // namespace

namespace qlin_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define QLIN_AVX512 1
#include "qlinear.inc"
#undef QLIN_AVX512
#pragma GCC pop_options
}  // namespace qlin_avx512

namespace qlin_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "qlinear.inc"
#pragma GCC pop_options
}  // namespace qlin_avx2

namespace {

std::string isa() {
  __builtin_cpu_init();
  if (std::getenv("KVMESH_QLINEAR_ISA") != nullptr) return std::getenv("KVMESH_QLINEAR_ISA");  // tests: force a path
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return "avx512";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return "avx2";
  return "";
}

float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// x [M, K] (rows contiguous) -> int8 codes [M, K], per block of 32: scale max|x| / 127, code
// round-to-nearest-even(x / scale) in [-127, 127]; 128 x the codes' sum, and the quantized x's
// sum (scale x the codes' sum, as llama.cpp's Q8_1 s), which the 4-bit offsets multiply: the
// kernel's result is then exactly W x̂ for the quantized x̂, off from W x by at most
// sum_k |W_k| scale / 2 (tests/worker/test_weight_formats.py's bound)
void quantize_x(const float* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* corr, float* sum) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* xb = x + i * kBlock;
      float amax = 0.f;
      for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
      const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t qs = 0;
      for (int k = 0; k < kBlock; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xb[k] * inv));
        q[i * kBlock + k] = static_cast<int8_t>(std::clamp(v, -127, 127));
        qs += q[i * kBlock + k];
      }
      d[i] = scale;
      corr[i] = 128 * qs;
      sum[i] = scale * static_cast<float>(qs);
    }
  });
}

}  // namespace

// x [M, K] against a packed weight [P, K / 32, record] of format fmt (0 Q8, 1 Q4, 2 BF16) with N
// rows -> [M, N] = residual + (x Wᵀ + bias); norm_weight, eps, gated as packed_linear.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor packed, int64_t fmt, int64_t N, c10::optional<torch::Tensor> bias,
                      c10::optional<torch::Tensor> residual, c10::optional<torch::Tensor> norm_weight, double eps,
                      bool gated) {
  static const std::string kIsa = isa();
  TORCH_CHECK(!kIsa.empty(), "qlinear: needs AVX2 + FMA + F16C");
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "qlinear: format 0, 1 or 2");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "qlinear: x [M, K] fp32 CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(2) == kRecord[fmt], "qlinear: packed [P, K / 32, record bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), nb = packed.size(1);
  TORCH_CHECK(K == nb * kBlock && N > (P - 1) * kPanel && N <= P * kPanel, "qlinear: shapes");
  TORCH_CHECK(!gated || (N % kPanel == 0 && !residual), "qlinear: a gated weight has 16k rows and no residual");
  auto xc = x.stride(1) == 1 ? x : x.contiguous();
  if (norm_weight) xc = kvmesh_rms_norm_rows(xc, *norm_weight, eps);
  torch::Tensor b, res;
  if (bias) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "qlinear: bias [N] fp32");
  }
  if (residual) {
    res = residual->stride(-1) == 1 ? *residual : residual->contiguous();
    TORCH_CHECK(res.scalar_type() == at::kFloat && res.dim() == 2 && res.size(0) == M && res.size(1) == N,
                "qlinear: residual [M, N] fp32");
  }
  auto out = torch::empty({M, gated ? N / 2 : N}, x.options());
  if (M == 0) return out;
  const bool quant = fmt != kBF16;
  torch::Tensor xq, xd, xcorr, xsum;
  if (quant) {
    if (xc.stride(0) != K) xc = xc.contiguous();
    xq = torch::empty({M, K}, x.options().dtype(at::kChar));
    xd = torch::empty({M, nb}, x.options());
    xcorr = torch::empty({M, nb}, x.options().dtype(at::kInt));
    xsum = torch::empty({M, nb}, x.options());
    quantize_x(xc.data_ptr<float>(), M, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xcorr.data_ptr<int32_t>(),
               xsum.data_ptr<float>());
  }
  const QProblem pr{xc.data_ptr<float>(), xc.stride(0), M, K, N, packed.data_ptr<uint8_t>(), P, nb, kRecord[fmt],
                    static_cast<int>(fmt), quant ? xq.data_ptr<int8_t>() : nullptr,
                    quant ? xd.data_ptr<float>() : nullptr, quant ? xcorr.data_ptr<int32_t>() : nullptr,
                    quant ? xsum.data_ptr<float>() : nullptr, bias ? b.data_ptr<float>() : nullptr,
                    residual ? res.data_ptr<float>() : nullptr, residual ? res.stride(0) : 0, gated,
                    out.data_ptr<float>()};
  if (kIsa == "avx512") qlin_avx512::run(pr);
  else qlin_avx2::run(pr);
  return out;
}

// rows `ids` [T] of a packed weight, dequantized -> [T, K] fp32 (the embedding lookup), bit-equal to
// worker.model.weights.QuantRows.dequantize()
torch::Tensor qrows(torch::Tensor packed, int64_t fmt, int64_t N, torch::Tensor ids) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  fmt >= 0 && fmt <= 2 && packed.size(2) == kRecord[fmt], "qrows: a packed weight");
  const auto idc = ids.to(at::kLong).contiguous();
  const int64_t T = idc.numel(), nb = packed.size(1), K = nb * kBlock, rec = kRecord[fmt];
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "qrows: id ", ip[t], " out of range");
  auto out = torch::empty({T, K}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = ip[t] / kPanel, j = ip[t] % kPanel;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const uint8_t* r = w + (p * nb + blk) * rec;
        float* o = op + t * K + blk * kBlock;
        if (fmt == kBF16) {
          for (int64_t kk = 0; kk < kBlock; ++kk) {
            uint16_t h;
            std::memcpy(&h, r + (kk * kPanel + j) * 2, 2);
            const uint32_t bits = static_cast<uint32_t>(h) << 16;
            std::memcpy(o + kk, &bits, 4);
          }
          continue;
        }
        const float d = half_to_float(r + 2 * j);
        // codes [8 quads of k][16 rows][4 k]; Q8 stored + 128, Q4 k < 16 low nibbles, k >= 16 high
        if (fmt == kQ8) {
          for (int64_t kk = 0; kk < kBlock; ++kk) {
            const uint8_t code = r[32 + (kk / 4) * 64 + j * 4 + kk % 4] ^ 0x80;
            o[kk] = d * static_cast<float>(static_cast<int8_t>(code));
          }
        } else {
          const float m = half_to_float(r + 32 + 2 * j);
          for (int64_t kk = 0; kk < kBlock; ++kk) {
            const uint8_t byte = r[64 + ((kk % 16) / 4) * 64 + j * 4 + kk % 4];
            o[kk] = d * static_cast<float>(kk < 16 ? byte & 15 : byte >> 4) + m;
          }
        }
      }
    }
  });
  return out;
}

// uint8 [nbytes] on 2 MiB-aligned memory advised for transparent huge pages (as pack_linear's)
torch::Tensor empty_huge_bytes(int64_t nbytes) {
  constexpr size_t kHuge = size_t(1) << 21;
  const size_t bytes = std::max<size_t>(kHuge, (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge * kHuge);
  void* ptr = std::aligned_alloc(kHuge, bytes);
  TORCH_CHECK(ptr != nullptr, "empty_huge_bytes: cannot allocate ", bytes, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(ptr, bytes, MADV_HUGEPAGE);
#endif
  return torch::from_blob(ptr, {nbytes}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kByte));
}

void bind_qlinear(pybind11::module& m) {
  m.def("qlinear", &qlinear, "residual + (x Wᵀ + bias) over a packed Q8 / Q4 / BF16 weight (CPU, any rows)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("fmt"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("norm_weight") = pybind11::none(), pybind11::arg("eps") = 1e-6, pybind11::arg("gated") = false);
  m.def("qrows", &qrows, "rows of a packed weight, dequantized to fp32");
  m.def("empty_huge_bytes", &empty_huge_bytes, "uint8 [n] on huge pages");
  m.def("qlinear_isa", []() { return isa(); }, "the instruction set qlinear runs: avx512, avx2 or ''");
}
