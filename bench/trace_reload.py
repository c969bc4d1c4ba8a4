#!/usr/bin/env python3
"""Where a paged reload's time goes on the GPU: bench/realmodel.py's KV
geometry (32 layers, 8 KV heads of 128, bf16, 16-token blocks, random
block ids) without the model, one warm-up store and load, then loads (and
one store, and one per-layer load) under torch.profiler, whose CUPTI
activity records every kernel and copy of the process, the engine's
included. Prints per op: the compute stream's span, the contiguous H2D
floor, and on the engine's streams the first and last activity, the busy
time, the gaps, and each kernel's or copy's share; writes the chrome trace
beside --out.

    KVOFFLOAD_LIB=build/gpu/libkvoffload.so PYTHONPATH=python \\
        python3 bench/trace_reload.py --blocks 128 --out /tmp/trace.md

Needs torch with CUDA and the kvoffload package; runs on the GPU machine.
"""
import argparse
import json
import os
import random
import re
import statistics
import sys
import time

LAYERS, KV_HEADS, HEAD_DIM, TPB = 32, 8, 128, 16
SEG = TPB * KV_HEADS * HEAD_DIM * 2


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    import kvoffload

    nmax = max(args.blocks)
    nblocks = 2 * nmax + 64
    kv = [(torch.zeros(nblocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
           torch.zeros(nblocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")) for _ in range(LAYERS)]
    for k, v in kv:
        k.view(torch.int16).random_(-30000, 30000)
        v.view(torch.int16).random_(-30000, 30000)
    pool = (2 * nmax + 16) * LAYERS * 2 * SEG
    eng = kvoffload.Engine.from_tensors(kv, pool_bytes=pool, first_region_bytes=pool, namespace="trace",
                                        policy="lru")
    compute = torch.cuda.current_stream()
    maxb = nmax * LAYERS * 2 * SEG
    host = torch.empty(maxb, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(maxb, dtype=torch.uint8, device="cuda")
    rng = random.Random(7)
    lines = []
    traces = []
    for n in args.blocks:
        ids = rng.sample(range(nblocks), 2 * n)
        src, dst = ids[:n], ids[n:]
        keys = kvoffload.chain_keys([rng.randrange(32000) for _ in range(n * TPB)], TPB, namespace="trace")

        def op(kind, per_layer=False):
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.profiler.record_function(f"{kind}{'-per-layer' if per_layer else ''}-{n}"):
                s.record(compute)
                t0 = time.perf_counter()
                if kind == "store":
                    o = eng.store(keys, src, after=compute)
                else:
                    o = eng.load(keys, dst, after=compute, per_layer=per_layer)
                call = (time.perf_counter() - t0) * 1e3
                if per_layer:
                    for layer in range(LAYERS):
                        o.wait_layer(layer, compute)
                o.wait_stream(compute)
                e.record(compute)
            e.synchronize()
            ms = s.elapsed_time(e)
            o.wait()
            o.release()
            return ms, call

        nbytes = n * LAYERS * 2 * SEG
        h, d = host[:nbytes], dev[:nbytes]
        floor = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(compute)
            d.copy_(h, non_blocking=True)
            e.record(compute)
            e.synchronize()
            floor.append(s.elapsed_time(e))
        op("store")
        op("load")
        op("load", per_layer=True)
        res = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res.append(("store",) + op("store"))
            for _ in range(args.reps):
                res.append(("load",) + op("load"))
            res.append(("load-per-layer",) + op("load", per_layer=True))
        path = os.path.splitext(args.out)[0] + f"-{n}.json"
        prof.export_chrome_trace(path)
        traces.append(path)
        lines.append(f"## {n} blocks ({nbytes / 1e9:.3f} GB), contiguous H2D floor {min(floor):.3f} ms\n")
        for kind, ms, call in res:
            lines.append(f"- {kind}: {ms:.3f} ms on the compute stream, call {call:.3f} ms")
        lines.append("")
        lines += analyse(path, min(floor))
        eng.delete(keys)
    eng.close()
    text = "# Paged reload traced (torch.profiler, CUPTI)\n\n" + "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    print("traces:", " ".join(traces))


OP_NAME = re.compile(r"^(store|load)(-per-layer)?-\d+$")


def analyse(path, floor):
    """Per op (its record_function span on the CPU, from the call), the GPU
    activity that started between it and the next op's, per stream: first start, last
    end, busy time, gaps over 5 µs, and the names of the activity. The
    CPU-side annotations, one per op, bound the windows: the GPU-side ones
    (gpu_user_annotation) split an op in two when a Store or Load issues
    its head on the caller's thread (the head's copies under the call's
    annotation, the rest after), which made the windows wrong."""
    with open(path) as f:
        tr = json.load(f)
    ev = [e for e in tr.get("traceEvents", []) if e.get("ph") == "X"]
    return windows(ev)


def windows(ev):
    """analyse's lines for the trace's complete events ev."""
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ops = [e for e in ev if e.get("cat") == "user_annotation" and OP_NAME.match(e.get("name", ""))]
    out = []
    ops = sorted(ops, key=lambda e: e["ts"])
    for i, o in enumerate(ops):
        # An op's GPU work starts after its call began and before the next
        # op's call (each op is waited for before the next starts).
        t0 = o["ts"]
        t1 = ops[i + 1]["ts"] if i + 1 < len(ops) else float("inf")
        inside = sorted((e for e in gpu if t0 - 50 <= e["ts"] < t1), key=lambda e: e["ts"])
        out.append(f"### {o['name']} (span {o['dur'] / 1e3:.3f} ms, {o.get('cat')})\n")
        by = {}
        for e in inside:
            by.setdefault(e.get("tid"), []).append(e)
        for tid, es in by.items():
            start, end = es[0]["ts"], max(e["ts"] + e["dur"] for e in es)
            busy = sum(e["dur"] for e in es)
            gaps, last = [], es[0]["ts"]
            for e in es:
                if e["ts"] - last > 5:
                    gaps.append((round(last - start, 1), round(e["ts"] - last, 1)))
                last = max(last, e["ts"] + e["dur"])
            names = {}
            for e in es:
                k = e["name"][:40]
                c = names.setdefault(k, [0, 0.0, []])
                c[0] += 1
                c[1] += e["dur"]
                c[2].append(e["dur"])
            out.append(f"- stream {tid}: first at +{(start - t0) / 1e3:.3f} ms, last end at +{(end - t0) / 1e3:.3f} ms, "
                       f"busy {busy / 1e3:.3f} ms of {(end - start) / 1e3:.3f}; {len(gaps)} gaps > 5 µs, "
                       f"{sum(g for _, g in gaps) / 1e3:.3f} ms in all: {gaps[:12]}")
            for k, (cnt, dur, ds) in sorted(names.items(), key=lambda kv: -kv[1][1]):
                out.append(f"  - {k}: {cnt}×, {dur / 1e3:.3f} ms, median {statistics.median(ds):.1f} µs, max {max(ds):.1f} µs")
        out.append("")
    return out


if __name__ == "__main__":
    sys.exit(main())
