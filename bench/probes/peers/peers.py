#!/usr/bin/env python3
"""Peers measured beside `kvoffload bench`, with the PyTorch on the GPU machine.

What a plain serving stack does instead of kvoffload, on the same machine and
the same sizes:

  pin_memory    torch.empty(n, dtype=uint8, pin_memory=True): time, and the
                bytes it really owns (PyTorch's CachingHostAllocator rounds to
                powers of two: 5 GiB asked -> 8 GiB owned), read from
                torch.cuda.host_memory_stats() and from VmRSS in
                /proc/self/status.
  copy_loop     a per-block offloader: one copy_(non_blocking=True) per block
                between a GPU KV tensor and a pinned host pool, at random slots
                on both sides.
  index_select  gather the blocks into a contiguous GPU staging buffer with
                index_select, then one copy_ (and the reverse for loads:
                one copy_ into staging, then index_copy_): fast, but it needs
                GPU memory as large as the batch.

Writes DIR/peers.json and prints a table. merge.py puts these figures beside
the engine's (DIR/summary.json from `kvoffload bench --out DIR`).

    python3 bench/probes/peers/peers.py --out DIR --sizes 4KiB,16KiB,64KiB,256KiB,2MiB
"""

import argparse
import json
import os
import platform
import re
import sys
import time

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
         "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(s):
    """Parse '4KiB', '2MiB', '1.5GiB', '4096' (the CLI's units) into bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", s)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {s!r} (use 4096, 64KiB, 1GiB, 2G, 100GB)")
    v = float(m.group(1)) * UNITS[m.group(2).lower()]
    if v != int(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {s!r}: must be a positive whole number of bytes")
    return int(v)


def size_list(s):
    return [parse_size(p) for p in s.split(",")]


def fmt_size(n):
    for unit, v in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= v:
            return f"{n / v:g} {unit}"
    return f"{n} B"


def vmrss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def host_allocated(torch):
    """Bytes the CachingHostAllocator holds (owned), or None when unknown."""
    stats_fn = getattr(torch.cuda, "host_memory_stats", None)
    if stats_fn is None:
        return None
    stats = stats_fn()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    for key, v in stats.items():
        if "allocated" in key and key.endswith("current"):
            return int(v)
    return None


def empty_host_cache(torch):
    fn = getattr(torch.cuda, "empty_host_cache", None) or getattr(getattr(torch, "_C", None), "_host_emptyCache", None)
    if fn is not None:
        fn()


def measure_pin_memory(torch, sizes):
    # CUDA initialisation is not pinning: done before the clock starts.
    torch.zeros(1, device="cuda")
    torch.empty(1, dtype=torch.uint8, pin_memory=True)
    rows = []
    for size in sizes:
        empty_host_cache(torch)
        rss0, owned0 = vmrss_bytes(), host_allocated(torch)
        t0 = time.perf_counter()
        x = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        seconds = time.perf_counter() - t0
        rss1, owned1 = vmrss_bytes(), host_allocated(torch)
        owned = None if owned0 is None or owned1 is None else owned1 - owned0
        rows.append({
            "size_bytes": size,
            "seconds": seconds,
            "ms_per_gib": seconds * 1000 / (size / (1 << 30)),
            "owned_bytes": owned,
            "rss_delta_bytes": rss1 - rss0,
            "extra_bytes": None if owned is None else owned - size,
        })
        del x
        empty_host_cache(torch)
    return rows


def timed(torch, fn, reps):
    """Best and median seconds of reps runs of fn after one warm-up, timed
    with CUDA events around everything fn enqueues."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return times[0], times[len(times) // 2]


def measure_copies(torch, sizes, total, reps, seed):
    """The per-block copy_ loop and index_select + one copy, both directions."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for seg in sizes:
        n = max(total // seg, 1)
        gpu = torch.empty((n, seg), dtype=torch.uint8, device=dev)
        gpu.random_(0, 256)
        host = torch.empty((n, seg), dtype=torch.uint8, pin_memory=True)
        blocks = torch.randperm(n, generator=gen)  # GPU block of the i-th copy
        slots = torch.randperm(n, generator=gen)   # host slot of the i-th copy
        bl, sl = blocks.tolist(), slots.tolist()
        gpu_rows = [gpu[b] for b in bl]
        host_rows = [host[s] for s in sl]
        nbytes = n * seg

        def d2h_loop():
            for g, h in zip(gpu_rows, host_rows):
                h.copy_(g, non_blocking=True)

        def h2d_loop():
            for g, h in zip(gpu_rows, host_rows):
                g.copy_(h, non_blocking=True)

        idx = blocks.to(dev)
        staging = torch.empty((n, seg), dtype=torch.uint8, device=dev)
        host_contig = torch.empty((n, seg), dtype=torch.uint8, pin_memory=True)

        def d2h_gather():
            torch.index_select(gpu, 0, idx, out=staging)
            host_contig.copy_(staging, non_blocking=True)

        def h2d_scatter():
            staging.copy_(host_contig, non_blocking=True)
            gpu.index_copy_(0, idx, staging)

        for method, d, fn in (("copy_loop", "d2h", d2h_loop), ("copy_loop", "h2d", h2d_loop),
                              ("index_select", "d2h", d2h_gather), ("index_select", "h2d", h2d_scatter)):
            best, med = timed(torch, fn, reps)
            rows.append({"method": method, "dir": d, "seg_bytes": seg, "blocks": n,
                         "gbps": nbytes / best / 1e9, "median_gbps": nbytes / med / 1e9})
        for r in rows[-2:]:
            r["gpu_staging_bytes"] = nbytes  # index_select's extra GPU memory: as large as the batch
        del gpu, host, staging, host_contig, gpu_rows, host_rows
        torch.cuda.empty_cache()
        empty_host_cache(torch)
    return rows


def table(res):
    out = [f"PyTorch {res['torch']} on {res['device']}", "",
           "| pin_memory size | seconds | ms/GiB | owned (allocator) | RSS delta | extra |", "|---|---|---|---|---|---|"]
    for r in res["pin_memory"]:
        owned = "?" if r["owned_bytes"] is None else fmt_size(r["owned_bytes"])
        extra = "?" if r["extra_bytes"] is None else fmt_size(r["extra_bytes"]) if r["extra_bytes"] > 0 else "0"
        out.append(f"| {fmt_size(r['size_bytes'])} | {r['seconds']:.2f} | {r['ms_per_gib']:.0f} | {owned} | "
                   f"{fmt_size(r['rss_delta_bytes'])} | {extra} |")
    out += ["", "| method | dir | block | GB/s (best) | GB/s (median) |", "|---|---|---|---|---|"]
    for r in res["copies"]:
        out.append(f"| {r['method']} | {r['dir']} | {fmt_size(r['seg_bytes'])} | {r['gbps']:.1f} | {r['median_gbps']:.1f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (peers.json is written there)")
    ap.add_argument("--sizes", type=size_list, default=size_list("4KiB,16KiB,64KiB,256KiB,2MiB"),
                    help="block sizes, comma-separated (default 4KiB,16KiB,64KiB,256KiB,2MiB)")
    ap.add_argument("--total", type=parse_size, default=parse_size("2GiB"), help="bytes per direction per timed run (default 2GiB)")
    ap.add_argument("--pool-sizes", type=size_list, default=size_list("1GiB,5GiB,17GiB,48GiB"),
                    help="pin_memory sizes, comma-separated (default 1GiB,5GiB,17GiB,48GiB, as kvoffload bench: the rounding shows at 5, 17 and 48)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per point (default 3)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps {args.reps} must be at least 1")
    try:
        import torch
    except ImportError as e:
        print(f"peers.py: PyTorch is needed: {e}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("peers.py: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    res = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0),
        "python": platform.python_version(),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])),
        "total_bytes": args.total,
        "pin_memory": measure_pin_memory(torch, args.pool_sizes),
        "copies": measure_copies(torch, args.sizes, args.total, args.reps, args.seed),
    }
    path = os.path.join(args.out, "peers.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2) if args.json else table(res))
    print(f"\nWrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
