"""A peer of the transfer tests: `python -m tests.kvstore.transfer_peer STORE_ADDRESS MODE`.

The test process hosts the rendezvous store and is member 0 (the receiver) of each pair;
this process joins the pair keyed MODE (two pairs, `silent` and `late`, for silent+late) as
member 1, builds the same pools from the same seeds (see `make_pool`) and plays the sender.
Modes:
  roundtrip  receive one transfer from member 0 while sending fp32 and int8-quantized blocks
  corrupt    send fp32 blocks, flipping one byte of block CORRUPT_INDEX after the checksum
  die        send only the preamble of a transfer, then exit hard (peer killed mid-transfer)
  silent     join the group and never send
  late       send fp32 blocks (member 0 receives them only after another peer timed out)
  silent+late  two pairs (silent, late), one thread each, to save a process
  mismatch   send fp32 blocks to a receiver that expects fewer; the send must fail, sending no payload
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
from kvstore.transfer.blocks import BlockSpec, BlockTransfer
from kvstore.transfer.group import PairGroup, PeerId, TransferConfig, TransferError, connect_store
from kvstore.transfer.wire import MAGIC, TAGS

SEND_IDS = [3, 7, 1, 5]  # pool block ids the sender gathers, in wire order
HASHES = [0, (1 << 128) - 1, 1 << 127, 0x0123456789ABCDEF_FEDCBA9876543210]
CORRUPT_INDEX = 2
LAYOUTS = {
    "fp32": KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="fp32"),
    "int8": KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, kv_cache_dtype="int8"),
}
TRANSFER_IDS = {"fp32": 11, "int8": 12, "reverse": 13, "corrupt": 14, "die": 15, "silent": 16, "late": 17,
                "mismatch": 18}


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


def join(address: str, key: str) -> PairGroup:
    """This process's end (member 1) of the pair `key` at the test's store."""
    cfg = TransferConfig(timeout_s=20.0, connect_timeout_s=30.0)
    return PairGroup.form(key, connect_store(address, 30.0), 1, PeerId("test", 0), "cpu", cfg)


def main(address: str, mode: str) -> int:
    group = join(address, mode)
    if mode == "silent":
        time.sleep(60)
        return 0
    if mode == "die":
        # a valid preamble (the wire format, by hand), so member 0 goes on to wait for the body
        nbytes = len(SEND_IDS) * BlockSpec.of(make_pool("fp32", seed=3).kv).bytes_per_block
        preamble = torch.tensor([MAGIC, TRANSFER_IDS["die"], len(SEND_IDS), nbytes], dtype=torch.int64)
        group.wait(group.isend(preamble, TAGS * TRANSFER_IDS["die"]), 20.0)
        os._exit(17)
    transfer = BlockTransfer(20.0, fault_hook=_flip_byte if mode == "corrupt" else None)
    if mode == "mismatch":
        future = transfer.send(group, TRANSFER_IDS[mode], make_pool("fp32", seed=3).gather_blocks(SEND_IDS), HASHES)
        error = future.exception(timeout=20)
        transfer.close()
        group.close()
        # Either it read our READY and refused ("receiver expects ..."), or the receiver, having
        # seen our preamble first, broke the pair before that READY was read: both fail the send
        # before any payload is posted (the payload goes out only after a matching READY).
        return 0 if isinstance(error, TransferError) else 4
    if mode in ("corrupt", "late"):
        blocks = make_pool("fp32", seed=3).gather_blocks(SEND_IDS)
        transfer.send(group, TRANSFER_IDS[mode], blocks, HASHES).result()
        # close before exit: a gloo group destroyed at interpreter exit while its threads
        # still run aborts the process ("terminate called without an active exception")
        transfer.close()
        group.close()
        return 0
    assert mode == "roundtrip", mode
    spec = BlockSpec.of(KVTensors(LAYOUTS["fp32"], 1).kv)
    pending = transfer.recv(group, TRANSFER_IDS["reverse"], len(SEND_IDS), spec)
    sent = [transfer.send(group, TRANSFER_IDS[kind], make_pool(kind, seed=1).gather_blocks(SEND_IDS), HASHES)
            for kind in ("fp32", "int8")]
    got = pending.result()
    for f in sent:
        f.result()
    ok = torch.equal(got.blocks, make_pool("fp32", seed=2).gather_blocks(SEND_IDS)) \
        and all(got.ok) and list(got.block_hashes) == HASHES
    transfer.close()
    group.close()
    return 0 if ok else 3


def main_silent_and_late(address: str) -> int:
    threading.Thread(target=main, args=(address, "silent"), daemon=True).start()
    code = main(address, "late")
    # the silent member's thread never ends on purpose: leave without tearing its group down
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[2] == "silent+late":
        sys.exit(main_silent_and_late(sys.argv[1]))
    sys.exit(main(sys.argv[1], sys.argv[2]))
