// Per-block checksums of a peer-transfer payload (kvstore/transfer_wire.py): XXH3-64 (seed 0) of
// each block's bytes, streamed piece by piece, bit-equal to the python `xxhash.xxh3_64` the wire
// used so far (the wire is unchanged; a worker without this kernel computes the same digests).
//
// A payload [L, 2, n, bs, H, D | slot_bytes] is sent in layer-contiguous pieces; a piece is
// [planes, n, chunk] bytes and block j's bytes are the j-th chunk of every plane, in plane order.
// The python path makes one `update` call per (plane, block) chunk (~0.3 us of interpreter each,
// 3,840 per 64-block transfer of the dev model) and runs at ~13 GB/s from memory; this reads the
// piece front to back in one call, with the GIL released, at the speed of its AVX2 loop.
//
// Only the long-input path of XXH3 is implemented: blocks of more than 240 bytes (the caller
// keeps the python path for smaller ones). Written from the XXH3 specification (its constants,
// its default 192-byte secret); tested bit-equal against python-xxhash (tests/worker/test_block_hash.py).
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr uint64_t kP32_1 = 0x9E3779B1ULL, kP32_2 = 0x85EBCA77ULL, kP32_3 = 0xC2B2AE3DULL;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ULL, kP64_2 = 0xC2B2AE3D27D4EB4FULL,
                   kP64_3 = 0x165667B19E3779F9ULL, kP64_4 = 0x85EBCA77C2B2AE63ULL,
                   kP64_5 = 0x27D4EB2F165667C5ULL;
constexpr int64_t kStripe = 64, kStripesPerBlock = 16, kMidsizeMax = 240;

alignas(64) constexpr uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
constexpr int64_t kScrambleAt = sizeof(kSecret) - kStripe;      // 128
constexpr int64_t kLastStripeAt = sizeof(kSecret) - kStripe - 7;  // 121
constexpr int64_t kMergeAt = 11;

// One block's stream, as int64 words of a row of the state tensor [n, kStateWords]:
// acc[8] | bytes fed | bytes buffered | a partial stripe (64 bytes) | the last 64 bytes of the block.
constexpr int64_t kAcc = 0, kFed = 8, kBuffered = 9, kBuf = 10, kTail = 18, kStateWords = 26;

inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);  // little-endian hosts only (x86-64, aarch64): checked at bind time
  return v;
}

inline void accumulate_stripe(uint64_t* acc, const uint8_t* in, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t data = read64(in + 8 * i), key = data ^ read64(secret + 8 * i);
    acc[i ^ 1] += data;
    acc[i] += (key & 0xFFFFFFFFULL) * (key >> 32);
  }
}

inline void scramble(uint64_t* acc) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= read64(kSecret + kScrambleAt + 8 * i);
    acc[i] = a * kP32_1;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// AVX-512 where the CPU has it (checked at run time: the extension is built with -mavx2 only):
// a stripe is one 512-bit lane set, half the instructions of the AVX2 loop.
#define KVMESH_AVX512 __attribute__((target("avx512f")))

KVMESH_AVX512 inline __m512i stripe512(__m512i acc, const uint8_t* in, const uint8_t* secret) {
  const __m512i data = _mm512_loadu_si512(in);
  const __m512i key = _mm512_xor_si512(data, _mm512_loadu_si512(secret));
  const __m512i product = _mm512_mul_epu32(key, _mm512_shuffle_epi32(key, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(0, 3, 0, 1))));
  const __m512i swapped = _mm512_shuffle_epi32(data, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_add_epi64(acc, _mm512_add_epi64(product, swapped));
}

KVMESH_AVX512 inline __m512i scramble512(__m512i acc) {
  const __m512i prime = _mm512_set1_epi32(static_cast<int>(kP32_1));
  __m512i x = _mm512_xor_si512(acc, _mm512_srli_epi64(acc, 47));
  x = _mm512_xor_si512(x, _mm512_loadu_si512(kSecret + kScrambleAt));
  const __m512i lo = _mm512_mul_epu32(x, prime), hi = _mm512_mul_epu32(_mm512_srli_epi64(x, 32), prime);
  return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));  // x * kP32_1 mod 2^64
}

KVMESH_AVX512 void run_stripes_avx512(uint64_t* acc, const uint8_t* in, int64_t first, int64_t count) {
  __m512i a = _mm512_loadu_si512(acc);
  int64_t i = 0;
  for (; i < count && (first + i) % kStripesPerBlock != 0; ++i) {  // up to the next 1 KiB block
    a = stripe512(a, in + i * kStripe, kSecret + 8 * ((first + i) % kStripesPerBlock));
    if ((first + i) % kStripesPerBlock == kStripesPerBlock - 1) a = scramble512(a);
  }
  for (; i + kStripesPerBlock <= count; i += kStripesPerBlock) {  // whole blocks: the bulk
    for (int k = 0; k < kStripesPerBlock; ++k) a = stripe512(a, in + (i + k) * kStripe, kSecret + 8 * k);
    a = scramble512(a);
  }
  for (int k = 0; i < count; ++i, ++k) a = stripe512(a, in + i * kStripe, kSecret + 8 * k);  // a block's head
  _mm512_storeu_si512(acc, a);
}

const bool kHasAvx512 = __builtin_cpu_supports("avx512f");
#else
constexpr bool kHasAvx512 = false;
#endif

// `count` consecutive stripes at `in`, the first being stripe `first` of the block (the bulk
// of the work: the accumulators stay in registers).
void run_stripes(uint64_t* acc, const uint8_t* in, int64_t first, int64_t count, bool avx512) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (avx512 && kHasAvx512) {
    run_stripes_avx512(acc, in, first, count);
    return;
  }
#endif
#if defined(__AVX2__)
  __m256i a[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4))};
  const __m256i prime = _mm256_set1_epi32(static_cast<int>(kP32_1));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = (first + i) % kStripesPerBlock;
    const uint8_t* p = in + i * kStripe;
    for (int h = 0; h < 2; ++h) {
      const __m256i data = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
      const __m256i key = _mm256_xor_si256(data, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kSecret + 8 * k + 32 * h)));
      const __m256i product = _mm256_mul_epu32(key, _mm256_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1)));  // lo32 * hi32
      a[h] = _mm256_add_epi64(a[h], _mm256_add_epi64(product, _mm256_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    if (k == kStripesPerBlock - 1) {
      for (int h = 0; h < 2; ++h) {
        __m256i x = _mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47));
        x = _mm256_xor_si256(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kSecret + kScrambleAt + 32 * h)));
        const __m256i lo = _mm256_mul_epu32(x, prime), hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
        a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));  // x * kP32_1 mod 2^64
      }
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a[1]);
#else
  for (int64_t i = 0; i < count; ++i) {
    const int64_t k = (first + i) % kStripesPerBlock;
    accumulate_stripe(acc, in + i * kStripe, kSecret + 8 * k);
    if (k == kStripesPerBlock - 1) scramble(acc);
  }
#endif
}

inline uint64_t fold_mul(uint64_t a, uint64_t b) {
  const __uint128_t p = static_cast<__uint128_t>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
}

// Feed `len` bytes at stream offset state[kFed] of a block of `total` bytes. Stripe s (64 bytes
// at 64 s) is accumulated when it ends at or before byte total - 1, and the accumulators are
// scrambled after every 16th: XXH3's long loop over the whole block; the last 64 bytes are kept
// for the final stripe of `digest`.
void feed(int64_t* state, const uint8_t* in, int64_t len, int64_t total, bool avx512) {
  uint64_t* acc = reinterpret_cast<uint64_t*>(state + kAcc);
  uint8_t* buf = reinterpret_cast<uint8_t*>(state + kBuf);
  uint8_t* tail = reinterpret_cast<uint8_t*>(state + kTail);
  const int64_t fed = state[kFed];
  int64_t buffered = state[kBuffered];  // == fed % 64: every byte is buffered or in a stripe run
  const int64_t tail_start = total - kStripe;
  if (fed + len > tail_start) {  // bytes of the final stripe
    const int64_t from = std::max(fed, tail_start);
    std::memcpy(tail + (from - tail_start), in + (from - fed), fed + len - from);
  }
  // stripes ending after byte total - 1 are not accumulated (the final stripe covers them)
  auto eligible = [&](int64_t start, int64_t count) {
    return start + kStripe <= total - 1 ? std::min(count, (total - 1 - start) / kStripe) : int64_t{0};
  };
  int64_t pos = 0;
  if (buffered > 0) {  // complete the partial stripe first
    pos = std::min(len, kStripe - buffered);
    std::memcpy(buf + buffered, in, pos);
    buffered += pos;
    if (buffered < kStripe) {
      state[kFed] = fed + len;
      state[kBuffered] = buffered;
      return;
    }
    const int64_t start = fed + pos - kStripe;
    run_stripes(acc, buf, start / kStripe, eligible(start, 1), avx512);
    buffered = 0;
  }
  const int64_t full = (len - pos) / kStripe, start = fed + pos;
  run_stripes(acc, in + pos, start / kStripe, eligible(start, full), avx512);
  pos += full * kStripe;
  std::memcpy(buf, in + pos, len - pos);
  state[kFed] = fed + len;
  state[kBuffered] = len - pos;
}

uint64_t digest(const int64_t* state, int64_t total) {
  uint64_t acc[8];
  std::memcpy(acc, state + kAcc, sizeof(acc));
  accumulate_stripe(acc, reinterpret_cast<const uint8_t*>(state + kTail), kSecret + kLastStripeAt);
  uint64_t h = static_cast<uint64_t>(total) * kP64_1;
  for (int i = 0; i < 4; ++i)
    h += fold_mul(acc[2 * i] ^ read64(kSecret + kMergeAt + 16 * i), acc[2 * i + 1] ^ read64(kSecret + kMergeAt + 16 * i + 8));
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  return h ^ (h >> 32);
}

void check_state(const torch::Tensor& state, int64_t total) {
  TORCH_CHECK(state.device().is_cpu() && state.scalar_type() == at::kLong && state.is_contiguous()
              && state.dim() == 2 && state.size(1) == kStateWords, "xxh3 blocks: state must be int64 [n, 26] (xxh3_blocks_init)");
  TORCH_CHECK(total > kMidsizeMax, "xxh3 blocks: blocks of more than 240 bytes only, got ", total);
}

torch::Tensor xxh3_blocks_init(int64_t n) {
  TORCH_CHECK(n >= 0, "xxh3_blocks_init: n must be >= 0");
  auto state = torch::zeros({n, kStateWords}, torch::kLong);
  const uint64_t init[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  int64_t* s = state.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) std::memcpy(s + j * kStateWords + kAcc, init, sizeof(init));
  return state;
}

// piece: uint8 [planes, n, chunk]; block j gets the j-th chunk of each plane, in plane order.
// avx512=false keeps to the AVX2 (or scalar) loop: for tests on a machine with AVX-512.
void xxh3_blocks_update(torch::Tensor state, torch::Tensor piece, int64_t total, bool avx512) {
  check_state(state, total);
  TORCH_CHECK(piece.device().is_cpu() && piece.scalar_type() == at::kByte && piece.is_contiguous() && piece.dim() == 3
              && piece.size(1) == state.size(0), "xxh3_blocks_update: piece must be contiguous uint8 [planes, n, chunk]");
  const int64_t planes = piece.size(0), n = piece.size(1), chunk = piece.size(2);
  int64_t* s = state.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    TORCH_CHECK(s[j * kStateWords + kFed] + planes * chunk <= total, "xxh3_blocks_update: more than ", total, " bytes fed to a block");
  const uint8_t* p = piece.data_ptr<uint8_t>();
  for (int64_t plane = 0; plane < planes; ++plane)  // front to back through memory
    for (int64_t j = 0; j < n; ++j)
      feed(s + j * kStateWords, p + (plane * n + j) * chunk, chunk, total, avx512);
}

torch::Tensor xxh3_blocks_digest(torch::Tensor state, int64_t total) {
  check_state(state, total);
  const int64_t n = state.size(0);
  const int64_t* s = state.data_ptr<int64_t>();
  auto out = torch::empty({n}, torch::kLong);
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j) {
    TORCH_CHECK(s[j * kStateWords + kFed] == total, "xxh3_blocks_digest: block ", j, " got ",
                s[j * kStateWords + kFed], " of its ", total, " bytes");
    o[j] = static_cast<int64_t>(digest(s + j * kStateWords, total));
  }
  return out;
}

}  // namespace

void bind_block_hash(pybind11::module& m) {
  const uint16_t probe = 1;
  uint8_t first;
  std::memcpy(&first, &probe, 1);
  TORCH_CHECK(first == 1, "block_hash: little-endian hosts only");
  m.def("xxh3_blocks_init", &xxh3_blocks_init, "per-block XXH3-64 streams: int64 state [n, 26]", pybind11::arg("n"));
  m.def("xxh3_blocks_update", &xxh3_blocks_update, "feed a piece uint8 [planes, n, chunk] to the n block streams",
        pybind11::arg("state"), pybind11::arg("piece"), pybind11::arg("total"), pybind11::arg("avx512") = true,
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("xxh3_blocks_digest", &xxh3_blocks_digest, "the n digests (int64, the uint64 bits) once `total` bytes were fed",
        pybind11::arg("state"), pybind11::arg("total"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("xxh3_isa") = kHasAvx512 ? "avx512" :
#if defined(__AVX2__)
      "avx2";
#else
      "scalar";
#endif
}
