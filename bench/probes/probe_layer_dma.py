#!/usr/bin/env python3
"""Probe (issue 21): can the copy engines gather one layer of many blocks?

A per-layer load moves, for each layer l, the 64 KiB run of layer l's K and
V out of every block's 2 MiB host slot. The copy kernel reads those runs
over the link at about 0.91 of a contiguous copy; a whole load bounces
through device staging by DMA at 0.94-0.97. This probe measures one pitched
DMA (cuMemcpy2DAsync: width = the layer's run, pitch = the slot, height =
slots in a staging chunk) per chunk, for every layer of 2048 blocks, against
a contiguous copy of the same bytes in the same run; slots consecutive, and
in shuffled runs of 4 and of 1. Needs torch and libcuda:

    python3 bench/probes/probe_layer_dma.py
"""
import random

import torch

from cudadrv import DEVICE, HOST, MEMCPY2D, copy2d, timed

LAYERS = 32
SLOT = 2 << 20
NBLOCKS = 2048


def main():
    torch.cuda.init()
    dev = torch.device("cuda")
    host = torch.empty(NBLOCKS * SLOT, dtype=torch.uint8).pin_memory()
    host.random_(0, 255)
    stream = torch.cuda.Stream()
    run = SLOT // LAYERS
    per_layer = NBLOCKS * run
    dst = torch.empty(per_layer * LAYERS, dtype=torch.uint8, device=dev)

    def plan(order, height, width):
        """2-D copies: layer by layer, rows = consecutive runs of slots in order, at most height each."""
        ds = []
        for l in range(LAYERS):
            i = 0
            while i < NBLOCKS:
                j = i + 1
                while j < NBLOCKS and j - i < height and order[j] == order[j - 1] + 1:
                    j += 1
                d = MEMCPY2D()
                d.srcMemoryType, d.srcHost, d.srcPitch = HOST, host.data_ptr() + order[i] * SLOT + l * run, SLOT
                d.dstMemoryType, d.dstDevice, d.dstPitch = DEVICE, dst.data_ptr() + l * per_layer + i * width, width
                d.WidthInBytes, d.Height = width, j - i
                ds.append(d)
                i = j
        return ds

    def run2d(ds):
        return lambda: copy2d(ds, stream)

    def contiguous():
        dst.copy_(host[: dst.numel()], non_blocking=True)

    rows = []
    ref0 = timed(stream, contiguous)
    consecutive = list(range(NBLOCKS))
    runs4 = [list(range(k, k + 4)) for k in range(0, NBLOCKS, 4)]
    random.Random(1).shuffle(runs4)
    shuffled4 = [s for r in runs4 for s in r]
    shuffled1 = list(range(NBLOCKS))
    random.Random(2).shuffle(shuffled1)
    for name, order, height in (("consecutive, chunks of 128 rows", consecutive, 128),
                                ("consecutive, one copy a layer", consecutive, NBLOCKS),
                                ("consecutive, chunks of 32 rows", consecutive, 32),
                                ("runs of 4 slots shuffled", shuffled4, 128),
                                ("slots shuffled (one row a copy)", shuffled1, 128)):
        ds = plan(order, height, run)
        best, med = timed(stream, run2d(ds))
        rows.append((name, len(ds), best, med))
    # half-width rows (K only of a layer): 32 KiB
    ref1 = timed(stream, contiguous)
    ref = min(ref0[0], ref1[0])
    total = dst.numel()
    # check one layer's bytes for the consecutive plan
    dst.zero_()
    run2d(plan(consecutive, 128, run))()
    stream.synchronize()
    got = dst[5 * per_layer: 6 * per_layer].view(NBLOCKS, run)[17].cpu()
    want = host[17 * SLOT + 5 * run: 17 * SLOT + 6 * run]
    assert torch.equal(got, want), "pitched copy moved the wrong bytes"
    print(f"contiguous {total >> 20} MiB H2D: best {ref:.2f} ms = {total / ref / 1e6:.1f} GB/s (before {ref0[0]:.2f}, after {ref1[0]:.2f})")
    print("| plan | copies | best ms | median ms | GB/s (best) | of contiguous |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, best, med in rows:
        print(f"| {name} | {n} | {best:.2f} | {med:.2f} | {total / best / 1e6:.1f} | {ref / best:.3f} |")


if __name__ == "__main__":
    main()
