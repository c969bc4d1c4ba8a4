"""Where a Python load() of many blocks spends its time (issue 21's "the
Python call's time reported beside" Go's): no model, the real-model
benchmark's KV geometry (32 layers, 8 KV heads of 128, 16-token bf16
blocks: 2 MiB a block) on the GPU, early events, blocks stored from random
GPU block ids and loaded into others.

Per size and rep it times, on the wall clock:
  prep  the package's argument checks and packing (pack_keys, _block_ids)
  call  load() as a caller makes it with lists (prep included), and with
        packed arguments (keys as one bytes object, ids as array('q'))
  raw   kvo_load through ctypes with arguments packed beforehand
and on the GPU (the caller's stream, events): reload (before the call
until the stream waited on the op) and, for a per-layer load, layer 0's
event. It prints the Go runtime's GC cycles during the timed loads when
GODEBUG=gctrace=1 is set (stderr, counted by the caller).

Usage: KVOFFLOAD_LIB=... PYTHONPATH=python python3 bench/pycall.py [--blocks 128 2048] [--reps 9]
"""

import argparse
import ctypes
import random
import statistics
import sys
import time

LAYERS, KV_HEADS, HEAD_DIM, TPB = 32, 8, 128, 16
BLOCK = 2 * LAYERS * TPB * KV_HEADS * HEAD_DIM * 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--label", default="")
    args = ap.parse_args(argv)

    import torch

    import kvoffload
    from kvoffload import _lib
    from kvoffload import engine as E
    from kvoffload import keys as K

    nmax = max(args.blocks)
    num_blocks = 2 * nmax + 64
    kv = [(torch.zeros(num_blocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
           torch.zeros(num_blocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
          for _ in range(LAYERS)]
    pool = (nmax + 16) * BLOCK
    eng = kvoffload.Engine.from_tensors(kv, pool_bytes=pool, first_region_bytes=pool, namespace="pycall",
                                        policy="lru", early_events=True)
    eng.wait_grown()
    lib = _lib.get()
    compute = torch.cuda.current_stream()
    rng = random.Random(1)
    rows = []
    for n in args.blocks:
        ids = rng.sample(range(num_blocks), 2 * n)
        src, dst = ids[:n], ids[n:]
        keys = kvoffload.chain_keys(range(rng.randrange(1 << 30), 0, -1)[:n * TPB], TPB, namespace="pycall")
        op = eng.store(keys, src, after=compute)
        outc = op.wait()
        op.release()
        if outc != ["stored"] * n:
            raise RuntimeError(f"store outcomes {sorted(set(outc))}")
        raw_keys, _ = K.pack_keys(keys)
        raw_ids = E._block_ids(dst, n)
        prep, call, packed, raw, reload, layer0 = [], [], [], [], [], []
        for rep in range(args.reps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            K.pack_keys(keys)
            E._block_ids(dst, n)
            prep.append((time.perf_counter() - t0) * 1e3)

            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(compute)
            t0 = time.perf_counter()
            op = eng.load(keys, dst, after=compute)
            call.append((time.perf_counter() - t0) * 1e3)
            op.wait_stream(compute)
            e.record(compute)
            e.synchronize()
            reload.append(s.elapsed_time(e))
            op.wait()
            op.release()

            torch.cuda.synchronize()
            s = torch.cuda.Event(enable_timing=True)
            l0 = torch.cuda.Event(enable_timing=True)
            s.record(compute)
            op = eng.load(keys, dst, after=compute, per_layer=True)
            op.wait_layer(0, compute)
            l0.record(compute)
            op.wait_stream(compute)
            l0.synchronize()
            layer0.append(s.elapsed_time(l0))
            op.wait()
            op.release()

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            op = eng.load(raw_keys, raw_ids, after=compute)
            packed.append((time.perf_counter() - t0) * 1e3)
            op.wait()
            op.release()

            torch.cuda.synchronize()
            o = ctypes.c_uint64(0)
            t0 = time.perf_counter()
            rc = lib.kvo_load(eng._h(), E._addr(raw_keys), E._addr(raw_ids), n, 0, 0, 0, 0, ctypes.byref(o))
            raw.append((time.perf_counter() - t0) * 1e3)
            _lib.check(rc, "kvo_load")
            _lib.check(lib.kvo_op_wait(o.value, -1), "kvo_op_wait")
            lib.kvo_op_release(o.value)
            if rep == 0:  # the warm-up rep is not counted
                for xs in (prep, call, packed, raw, reload, layer0):
                    xs.clear()
        med = statistics.median
        rows.append((n, med(prep), med(call), min(call), max(call), med(packed), med(raw), med(reload), med(layer0),
                     n * BLOCK / 1e6))
        eng.delete(keys)
    eng.close()
    print(f"\n{args.label}: median of {args.reps} reps (ms)")
    print("| blocks | MB | prep (lists) | load() call, lists (min–max) | load() call, packed | raw kvo_load | reload (GPU) | per-layer layer 0 (GPU) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, p, c, cmin, cmax, pk, r, rl, l0, mb in rows:
        print(f"| {n} | {mb:.0f} | {p:.3f} | {c:.3f} ({cmin:.3f}–{cmax:.3f}) | {pk:.3f} | {r:.3f} | {rl:.2f} | {l0:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
