#!/usr/bin/env python3
"""Probe: can the copy engines move a TP rank's head range at link speed?

A head-sliced copy (issue 24) moves, per block, the rank's heads of every
layer's K and V: in the head-major host record these are runs of
heads*tokens*head_dim*dtype bytes at a pitch of the model's whole head run.
The copy kernel reaches about 88% of the link on such 4 KiB pieces; this
probe measures cuMemcpy2DAsync (one pitched DMA per block: width = the
rank's run, pitch = all heads' run, height = layers*2) between the host
records and a contiguous device staging buffer, against a contiguous copy of
the same bytes in the same run. Needs torch (for pinned and device memory)
and libcuda; run on the GPU machine:

    python3 bench/probes/probe_2d_dma.py
"""
import random

import torch

from cudadrv import DEVICE, HOST, MEMCPY2D, copy2d, timed

LAYERS, HEADS, HEAD_DIM, TOKENS, DT = 32, 8, 128, 16, 2
HEAD_RUN = TOKENS * HEAD_DIM * DT          # 4 KiB: one head of one layer's K
LAYER_RUN = HEADS * HEAD_RUN               # 32 KiB: all heads of one layer's K
BLOCK = LAYERS * 2 * LAYER_RUN             # 2 MiB
NBLOCKS = 1024


def main():
    torch.cuda.init()
    dev = torch.device("cuda")
    host = torch.empty(NBLOCKS * BLOCK, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    rows = []

    for tp in (1, 2, 4, 8):
        heads = HEADS // tp
        width = heads * HEAD_RUN
        per_block = LAYERS * 2 * width
        nbytes = NBLOCKS * per_block
        staging = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        slots = list(range(NBLOCKS))
        random.Random(tp).shuffle(slots)
        first = (tp - 1) * 0 + heads * (tp // 2 if tp > 1 else 0)  # some head range
        descs = {}
        for h2d in (True, False):
            ds = []
            for i, s in enumerate(slots):
                d = MEMCPY2D()
                hp = host.data_ptr() + s * BLOCK + first * HEAD_RUN
                dp = staging.data_ptr() + i * per_block
                if h2d:
                    d.srcMemoryType, d.srcHost, d.srcPitch = HOST, hp, LAYER_RUN
                    d.dstMemoryType, d.dstDevice, d.dstPitch = DEVICE, dp, width
                else:
                    d.srcMemoryType, d.srcDevice, d.srcPitch = DEVICE, dp, width
                    d.dstMemoryType, d.dstHost, d.dstPitch = HOST, hp, LAYER_RUN
                d.WidthInBytes, d.Height = width, LAYERS * 2
                ds.append(d)
            descs[h2d] = ds
        for h2d in (True, False):
            ds = descs[h2d]

            def pitched():
                copy2d(ds, stream)

            hv = host[:nbytes]

            def contiguous():
                if h2d:
                    staging.copy_(hv, non_blocking=True)
                else:
                    hv.copy_(staging, non_blocking=True)

            c0 = timed(stream, contiguous)
            p = timed(stream, pitched)
            c1 = timed(stream, contiguous)
            ref = min(c0[0], c1[0])
            rows.append((tp, "H2D" if h2d else "D2H", width, nbytes, ref, p[0], p[1]))
        # correctness of one direction: H2D then compare a block
        host[: 4 * BLOCK].random_(0, 255)
        copy2d(descs[True], stream)
        stream.synchronize()
        i = slots.index(0)
        got = staging[i * per_block:(i + 1) * per_block].cpu().view(LAYERS * 2, width)
        want = host[:BLOCK].view(LAYERS * 2, LAYER_RUN)[:, first * HEAD_RUN:first * HEAD_RUN + width]
        assert torch.equal(got, want), "pitched copy moved the wrong bytes"
        del staging

    print("| TP | dir | row bytes | MiB | contiguous GB/s | pitched best GB/s | pitched/contiguous | pitched median GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tp, d, w, n, ref, best, med in rows:
        print(f"| {tp} | {d} | {w} | {n >> 20} | {n / ref / 1e6:.1f} | {n / best / 1e6:.1f} | {ref / best:.3f} | {n / med / 1e6:.1f} |")


if __name__ == "__main__":
    main()
