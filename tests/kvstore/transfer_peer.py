"""A peer of the transfer tests: `python -m tests.kvstore.transfer_peer PORT MODE [RANK WORLD]`.

The test process is rank 0 (the receiver); this process (rank 1 of 2 unless told) builds
the same pools from the same seeds (see `make_pool`) and plays the sender. Modes:
  roundtrip  receive one transfer from rank 0 while sending fp32 and int8-quantized blocks
  corrupt    send fp32 blocks, flipping one byte of block CORRUPT_INDEX after the checksum
  die        send only the preamble of a transfer, then exit hard (peer killed mid-transfer)
  silent     join the group and never send
  late       send fp32 blocks (rank 0 receives them only after another peer timed out)
  silent+late  ranks 1 (silent) and 2 (late) of 3, one thread each, to save a process
Exit status 0 means every check on this side passed.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import torch

from kvstore.layout import KVLayout
from kvstore.tensors import KVTensors
from kvstore.transfer import _MAGIC, BlockSpec, BlockTransfer
from kvstore.transfer_group import TransferConfig, TransferGroup

SEND_IDS = [3, 7, 1, 5]  # pool block ids the sender gathers, in wire order
HASHES = [0, (1 << 128) - 1, 1 << 127, 0x0123456789ABCDEF_FEDCBA9876543210]
CORRUPT_INDEX = 2
LAYOUTS = {
    "fp32": KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="fp32"),
    "int8": KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="int8"),
}
TRANSFER_IDS = {"fp32": 11, "int8": 12, "reverse": 13, "corrupt": 14, "die": 15, "silent": 16, "late": 17}


def make_pool(kind: str, seed: int, num_blocks: int = 8) -> KVTensors:
    """A pool filled with seeded random content: fp32 values, or raw slot bytes for int8."""
    pool = KVTensors(LAYOUTS[kind], num_blocks)
    gen = torch.Generator().manual_seed(seed)
    if pool.dtype == torch.uint8:
        pool.kv.copy_(torch.randint(0, 256, pool.kv.shape, generator=gen, dtype=torch.uint8))
    else:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen))
    return pool


def _flip_byte(transfer_id: int, blocks: torch.Tensor) -> None:
    plane = blocks[1, 1, CORRUPT_INDEX]  # [bs, H, D] of layer 1, V
    plane.view(torch.uint8).view(-1)[5] ^= 0x01


def main(port: int, mode: str, rank: int, world_size: int) -> int:
    group = TransferGroup.form(TransferConfig(rank=rank, world_size=world_size, master_port=port, timeout_s=20.0))
    if mode == "silent":
        time.sleep(60)
        return 0
    if mode == "die":
        # a valid preamble (the wire format, by hand), so rank 0 goes on to wait for the body
        nbytes = len(SEND_IDS) * BlockSpec.of(make_pool("fp32", seed=3).kv).bytes_per_block
        preamble = torch.tensor([_MAGIC, TRANSFER_IDS["die"], len(SEND_IDS), nbytes], dtype=torch.int64)
        group.wait(group.isend(preamble, 0, 3 * TRANSFER_IDS["die"]), 20.0)
        os._exit(17)
    transfer = BlockTransfer(group, fault_hook=_flip_byte if mode == "corrupt" else None)
    if mode in ("corrupt", "late"):
        blocks = make_pool("fp32", seed=3).gather_blocks(SEND_IDS)
        transfer.send(0, TRANSFER_IDS[mode], blocks, HASHES).result()
        # close before exit: a gloo group destroyed at interpreter exit while its threads
        # still run aborts the process ("terminate called without an active exception")
        transfer.close()
        group.close()
        return 0
    assert mode == "roundtrip", mode
    spec = BlockSpec.of(KVTensors(LAYOUTS["fp32"], 1).kv)
    pending = transfer.recv(0, TRANSFER_IDS["reverse"], len(SEND_IDS), spec)
    sent = [transfer.send(0, TRANSFER_IDS[kind], make_pool(kind, seed=1).gather_blocks(SEND_IDS), HASHES)
            for kind in ("fp32", "int8")]
    got = pending.result()
    for f in sent:
        f.result()
    ok = torch.equal(got.blocks, make_pool("fp32", seed=2).gather_blocks(SEND_IDS)) \
        and all(got.ok) and list(got.block_hashes) == HASHES
    transfer.close()
    group.close()
    return 0 if ok else 3


def main_silent_and_late(port: int) -> int:
    threading.Thread(target=main, args=(port, "silent", 1, 3), daemon=True).start()
    code = main(port, "late", 2, 3)
    # the silent rank's thread never ends on purpose: leave without tearing its group down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[2] == "silent+late":
        sys.exit(main_silent_and_late(int(sys.argv[1])))
    rank, world_size = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 3 else (1, 2)
    sys.exit(main(int(sys.argv[1]), sys.argv[2], rank, world_size))
