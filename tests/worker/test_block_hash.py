"""The native per-block checksums (worker/kernels/csrc/block_hash.cpp) against python-xxhash.

Oracle: `xxhash.xxh3_64_intdigest` of each block's bytes laid end to end (plane by plane), the
checksum the wire has always carried; the python `BlockHashers` path must give it too, for any
cut of the payload into pieces, so either side of a transfer may lack the kernel.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import xxhash

from kvstore.transfer.wire import BlockHashers, block_checksums
from worker.kernels import native


@pytest.fixture(scope="module")
def kernel() -> Iterator[object]:
    module = native.checksum_kernel()
    assert module is not None, "the native CPU kernels did not build (see the warning above)"
    yield module


def oracle(payload: torch.Tensor) -> list[int]:
    """[L, 2, n, ...] -> xxh3_64 of each block's 2L chunks end to end."""
    planes = payload.reshape(payload.shape[0] * 2, payload.shape[2], -1).contiguous().view(torch.uint8)
    return [xxhash.xxh3_64_intdigest(planes[:, j].contiguous().numpy().tobytes()) for j in range(payload.shape[2])]


def payload(num_layers: int, n: int, chunk_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_layers, 2, n, chunk_bytes), generator=gen, dtype=torch.uint8)


def digests(blocks: torch.Tensor, cuts: list[int], kernel: object | None) -> list[int]:
    n = blocks.shape[2]
    hashers = BlockHashers(n, blocks.numel() * blocks.element_size() // n, kernel)  # type: ignore[arg-type]
    assert hashers.native == (kernel is not None and blocks.numel() * blocks.element_size() // n >= 241)
    for a, b in zip([0, *cuts], [*cuts, blocks.shape[0]]):
        hashers.update(blocks[a:b])
    return hashers.digests()


# chunk sizes: stripe-aligned (the dev model's 12 KiB), unaligned, a block of exactly 241 bytes
# (the smallest the kernel takes), 1024 and 1025 bytes (XXH3's block boundary, and one past it)
@pytest.mark.parametrize(("num_layers", "chunk_bytes"), [(30, 12288), (3, 256), (7, 100), (1, 121), (4, 128),
                                                         (1, 512), (5, 205), (2, 4100)])
def test_native_equals_python_and_oracle_for_every_cut(kernel: object, num_layers: int, chunk_bytes: int) -> None:
    blocks = payload(num_layers, 5, chunk_bytes, seed=num_layers * chunk_bytes)
    want = oracle(blocks)
    rng = random.Random(chunk_bytes)
    cut_sets = [[], list(range(1, num_layers))]
    cut_sets += [sorted(rng.sample(range(1, num_layers), rng.randint(1, num_layers - 1))) for _ in range(3)
                 if num_layers > 1]
    for cuts in cut_sets:
        assert digests(blocks, cuts, kernel) == want, cuts
        assert digests(blocks, cuts, None) == want, cuts


@pytest.mark.parametrize("avx512", [True, False], ids=["best-isa", "avx2-or-scalar"])
def test_each_vector_path_equals_the_oracle(kernel: object, avx512: bool) -> None:
    """The kernel takes AVX-512 where the CPU has it; avx512=False keeps to the AVX2 (or
    scalar) loop, so both run on a machine with AVX-512."""
    for num_layers, chunk_bytes, cut in ((30, 12288, 7), (3, 100, 1), (2, 1000, 1)):
        blocks = payload(num_layers, 4, chunk_bytes, seed=chunk_bytes)
        total = 2 * num_layers * chunk_bytes
        state = kernel.xxh3_blocks_init(4)  # type: ignore[attr-defined]
        for part in (blocks[:cut], blocks[cut:]):
            kernel.xxh3_blocks_update(state, part.reshape(-1, 4, chunk_bytes).contiguous(), total,  # type: ignore[attr-defined]
                                      avx512=avx512)
        got = [v % (1 << 64) for v in kernel.xxh3_blocks_digest(state, total).tolist()]  # type: ignore[attr-defined]
        assert got == oracle(blocks), (num_layers, chunk_bytes)


def test_total_of_exactly_241_bytes_and_fp32_views(kernel: object) -> None:
    raw = payload(1, 3, 241, seed=1)        # 2 planes of 241 bytes: 482 per block
    assert digests(raw, [], kernel) == oracle(raw)
    tiny = payload(1, 3, 120, seed=2)       # 240 bytes per block: XXH3's short path, python only
    assert digests(tiny, [], kernel) == oracle(tiny)
    fp32 = torch.randn(3, 2, 4, 4, 2, 8)    # [L, 2, n, bs, H, D] as gathered from a pool
    assert block_checksums(fp32, 4, kernel) == block_checksums(fp32, 4) == oracle(fp32.view(torch.uint8))  # type: ignore[arg-type]


def test_every_flipped_byte_changes_its_block_only(kernel: object) -> None:
    blocks = payload(2, 3, 1000, seed=7)
    base = block_checksums(blocks, 3, kernel)  # type: ignore[arg-type]
    rng = random.Random(7)
    for _ in range(40):
        layer, kv, j, i = rng.randrange(2), rng.randrange(2), rng.randrange(3), rng.randrange(1000)
        changed = blocks.clone()
        changed[layer, kv, j, i] ^= 1 << rng.randrange(8)
        sums = block_checksums(changed, 3, kernel)  # type: ignore[arg-type]
        assert [a != b for a, b in zip(base, sums)] == [k == j for k in range(3)], (layer, kv, j, i)


def test_kernel_checks_its_inputs(kernel: object) -> None:
    k = kernel
    state = k.xxh3_blocks_init(2)  # type: ignore[attr-defined]
    piece = torch.zeros(2, 2, 300, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="more than 240"):
        k.xxh3_blocks_update(state, piece, 240)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="uint8"):
        k.xxh3_blocks_update(state, piece.float(), 600)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="uint8"):
        k.xxh3_blocks_update(state, torch.zeros(2, 3, 300, dtype=torch.uint8), 600)  # type: ignore[attr-defined]
    k.xxh3_blocks_update(state, piece, 900)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="got 600 of its 900"):
        k.xxh3_blocks_digest(state, 900)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="more than 900 bytes"):
        k.xxh3_blocks_update(state, torch.zeros(2, 2, 301, dtype=torch.uint8), 900)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="state"):
        k.xxh3_blocks_update(torch.zeros(2, 5, dtype=torch.long), piece, 900)  # type: ignore[attr-defined]


def test_kernels_off_leaves_the_python_checksums(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVMESH_NATIVE_KERNELS=0 (or a failed build): no kernel, the same digests from python."""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    native.load.cache_clear()
    try:
        assert native.checksum_kernel() is None
        blocks = payload(3, 4, 256, seed=3)
        assert block_checksums(blocks, 4, native.checksum_kernel()) == oracle(blocks)
    finally:
        monkeypatch.undo()
        native.load.cache_clear()


@pytest.mark.multiproc
def test_transfers_between_a_native_and_a_python_side(kernel: object) -> None:
    """This process hashes natively, the peer process in python: the round trip (both
    directions) verifies, and a byte flipped after the peer's checksum fails that block only."""
    from tests.kvstore.test_transfer import check_corrupted_block, check_round_trip
    check_round_trip(kernel)  # type: ignore[arg-type]
    check_corrupted_block(kernel)  # type: ignore[arg-type]
