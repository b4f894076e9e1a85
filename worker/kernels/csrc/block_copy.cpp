// Whole KV blocks between the device pool's layout and the host tier's (kvstore/tiers.py).
//
// The pool stores [L, 2, Nd, bs, H, D | slot_bytes]: one block is L*2 rows of `run` contiguous
// bytes, Nd runs apart. The host tier stores [Nh, L, 2, bs, H, D | slot_bytes]: one block is one
// contiguous range. Moving n scattered blocks is n*L*2 memcpys of `run` bytes; torch's copy_ of a
// strided block view per block runs at ~0.7x a plain memcpy here (a TensorIterator set-up per
// block, and its split of a 6-d view across threads), this runs them as one parallel loop.
// The bytes are never reinterpreted: values and quantization scales move alike.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// host[slots[k]] <-> pool[:, :, ids[k]] for every k; `to_host` picks the direction.
void copy_blocks(torch::Tensor host, torch::Tensor slots, torch::Tensor pool, torch::Tensor ids, bool to_host) {
  TORCH_CHECK(host.device().is_cpu() && pool.device().is_cpu(), "copy_blocks: CPU tensors only");
  TORCH_CHECK(host.is_contiguous() && pool.is_contiguous(), "copy_blocks: contiguous tensors only");
  TORCH_CHECK(host.scalar_type() == pool.scalar_type(), "copy_blocks: host and pool dtypes differ");
  TORCH_CHECK(pool.dim() >= 4 && host.dim() == pool.dim(), "copy_blocks: pool [L, 2, N, ...], host [N, L, 2, ...]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && ids.scalar_type() == at::kLong && slots.is_contiguous()
              && ids.is_contiguous() && slots.numel() == ids.numel(), "copy_blocks: slots/ids int64, equal length");
  const int64_t rows = pool.size(0) * pool.size(1);
  const int64_t nd = pool.size(2), nh = host.size(0);
  TORCH_CHECK(host.size(1) == pool.size(0) && host.size(2) == pool.size(1), "copy_blocks: layer/kv dims differ");
  const int64_t run = (nd == 0 ? 0 : pool.numel() / (rows * nd)) * pool.element_size();
  TORCH_CHECK(nh == 0 || host.numel() / nh * host.element_size() == rows * run, "copy_blocks: block sizes differ");
  const int64_t n = ids.numel();
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t* b = ids.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k)
    TORCH_CHECK(0 <= s[k] && s[k] < nh && 0 <= b[k] && b[k] < nd, "copy_blocks: slot or block id out of range");
  char* h = static_cast<char*>(host.data_ptr());
  char* p = static_cast<char*>(pool.data_ptr());
  // k-major: each thread fills whole host blocks front to back (one stream per thread)
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(run, 1));
  at::parallel_for(0, n * rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t k = i / rows, r = i % rows;
      char* hp = h + (s[k] * rows + r) * run;
      char* pp = p + (r * nd + b[k]) * run;
      if (to_host) std::memcpy(hp, pp, run); else std::memcpy(pp, hp, run);
    }
  });
}

}  // namespace

void bind_block_hash(pybind11::module& m);  // csrc/block_hash.cpp: per-block checksums of a peer-transfer payload

void bind_block_copy(pybind11::module& m) {
  bind_block_hash(m);  // bound here so the module's entry point (paged_decode.cpp) needs no change
  m.def("copy_blocks", &copy_blocks, "host[slots[k]] <-> pool[:, :, ids[k]] (CPU; to_host picks the direction)",
        pybind11::arg("host"), pybind11::arg("slots"), pybind11::arg("pool"), pybind11::arg("ids"),
        pybind11::arg("to_host"));
}
