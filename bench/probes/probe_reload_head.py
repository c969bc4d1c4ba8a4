"""Probe (issue 21): where the Python path's reload of 2k tokens loses its
0.2-0.3 ms against Go's paged benchmark. Go's BenchmarkGPUPagedReload
reloads 128 blocks of the real-model geometry at 0.94-0.95 of the link;
bench/realmodel.py, through the Python package, at 0.90. One engine in the
default mode (as realmodel.py's), 128 blocks stored once, then the variants
below interleaved rep by rep, each timed on the GPU as realmodel.py times a
reload (an event on the compute stream just before the call, another after
the stream waited on the op):

  list+after   load(keys list, ids list, after=compute): realmodel.py's call
  list         the same without after
  packed+after keys as one bytes object, ids as array('q')
  raw          kvo_load through ctypes, arguments packed beforehand, no after
  warm+after   list+after right after a lookup of one key (the library's
               threads just ran), no synchronize between
  slept+after  list+after after a 2 ms sleep of the calling thread (and
               after 20 and 60 ms)
  prefilled+after (--model) list+after right after a 2048-token prefill of
               realmodel.py's model; then the same after a 10 ms sleep,
               with Python's gc off, after 40 bf16 8k matmuls instead of
               the prefill, after making 100k Python objects instead

and the contiguous pinned H2D copy of the same bytes (best of the reps)
before and after. Prints one table: median, min and floor/median per
variant.

Usage: KVOFFLOAD_LIB=... PYTHONPATH=python python3 bench/probes/probe_reload_head.py [--blocks 128] [--reps 15]
"""

import argparse
import ctypes
import random
import statistics
import time

LAYERS, KV_HEADS, HEAD_DIM, TPB = 32, 8, 128, 16
BLOCK = 2 * LAYERS * TPB * KV_HEADS * HEAD_DIM * 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pool-blocks", type=int, default=0,
                    help="the host pool in blocks (default: the blocks + 16; realmodel.py's is 4112)")
    ap.add_argument("--kv-blocks", type=int, default=0,
                    help="the GPU KV cache in blocks (default: 2 x the blocks + 64; realmodel.py's is 4160)")
    ap.add_argument("--model", action="store_true",
                    help="build realmodel.py's model (random 8B-class Llama) first, and add a variant timed right "
                         "after a 2048-token prefill (prefilled+after)")
    ap.add_argument("--trace", metavar="PATH",
                    help="with --model: after the reps, 3 loads right after a prefill then 3 plain ones under "
                         "torch.profiler (CUPTI), the trace at PATH, per-stream activity printed (trace_reload.py's)")
    args = ap.parse_args(argv)

    import torch

    import kvoffload
    from kvoffload import _lib
    from kvoffload import engine as E
    from kvoffload import keys as K

    n = args.blocks
    model = None
    if args.model:
        import os
        import sys
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/
        import realmodel as R
        model = R.build_model(2048, 1)
        prompt = torch.randint(0, R.VOCAB, (1, 2048), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
        R.prefill(model, prompt)
        torch.cuda.synchronize()
    num_blocks = args.kv_blocks or 2 * n + 64
    kv = [(torch.zeros(num_blocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
           torch.zeros(num_blocks, TPB, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"))
          for _ in range(LAYERS)]
    pool = (args.pool_blocks or n + 16) * BLOCK
    eng = kvoffload.Engine.from_tensors(kv, pool_bytes=pool, first_region_bytes=pool, namespace="probe",
                                        policy="lru")
    eng.wait_grown()
    lib = _lib.get()
    compute = torch.cuda.current_stream()
    rng = random.Random(3)
    ids = rng.sample(range(num_blocks), 2 * n)
    src, dst = ids[:n], ids[n:]
    keys = kvoffload.chain_keys(range(rng.randrange(1 << 30), 0, -1)[:n * TPB], TPB, namespace="probe")
    op = eng.store(keys, src, after=compute)
    if op.wait() != ["stored"] * n:
        raise RuntimeError("store failed")
    op.release()
    raw_keys, _ = K.pack_keys(keys)
    raw_ids = E._block_ids(dst, n)

    nbytes = n * BLOCK
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def floor():
        best = None
        for _ in range(5):
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(compute)
            dev.copy_(host, non_blocking=True)
            e.record(compute)
            e.synchronize()
            ms = s.elapsed_time(e)
            best = ms if best is None else min(best, ms)
        return best

    def timed(call, sync=True):
        if sync:
            torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(compute)
        o = call()
        o.wait_stream(compute)
        e.record(compute)
        e.synchronize()
        ms = s.elapsed_time(e)
        if o.wait() != ["loaded"] * n:
            raise RuntimeError("load failed")
        o.release()
        return ms

    class RawOp:
        def __init__(self, h):
            self.h = h

        def wait_stream(self, stream):
            _lib.check(lib.kvo_op_stream_wait(self.h, stream.cuda_stream), "kvo_op_stream_wait")

        def wait(self):
            _lib.check(lib.kvo_op_wait(self.h, -1), "kvo_op_wait")
            return ["loaded"] * n

        def release(self):
            lib.kvo_op_release(self.h)

    def raw():
        o = ctypes.c_uint64(0)
        _lib.check(lib.kvo_load(eng._h(), E._addr(raw_keys), E._addr(raw_ids), n, 0, 0, 0, 0, ctypes.byref(o)),
                   "kvo_load")
        return RawOp(o.value)

    def warm():
        torch.cuda.synchronize()
        eng.lookup(keys[:1])
        return timed(lambda: eng.load(keys, dst, after=compute), sync=False)

    def slept(seconds=0.002):
        torch.cuda.synchronize()
        time.sleep(seconds)
        return timed(lambda: eng.load(keys, dst, after=compute), sync=False)

    def prefilled():
        R.prefill(model, prompt)
        torch.cuda.synchronize()
        return timed(lambda: eng.load(keys, dst, after=compute))

    variants = [
        ("list+after", lambda: timed(lambda: eng.load(keys, dst, after=compute))),
        ("list", lambda: timed(lambda: eng.load(keys, dst))),
        ("packed+after", lambda: timed(lambda: eng.load(raw_keys, raw_ids, after=compute))),
        ("raw", lambda: timed(raw)),
        ("warm+after", warm),
        ("slept+after", slept),
        ("slept 20 ms", lambda: slept(0.02)),
        ("slept 60 ms", lambda: slept(0.06)),
    ]
    if model is not None:
        import gc

        big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

        def prefilled_slept():
            R.prefill(model, prompt)
            torch.cuda.synchronize()
            time.sleep(0.01)
            return timed(lambda: eng.load(keys, dst, after=compute), sync=False)

        def prefilled_nogc():
            R.prefill(model, prompt)
            torch.cuda.synchronize()
            gc.disable()
            try:
                return timed(lambda: eng.load(keys, dst, after=compute))
            finally:
                gc.enable()

        def matmuls():
            for _ in range(40):
                big @ big
            torch.cuda.synchronize()
            return timed(lambda: eng.load(keys, dst, after=compute))

        def pyobjs():
            junk = [{"a": i} for i in range(100000)]
            del junk
            return timed(lambda: eng.load(keys, dst, after=compute))

        variants += [("prefilled+after", prefilled), ("prefilled, 10 ms sleep", prefilled_slept),
                     ("prefilled, gc off", prefilled_nogc), ("40 matmuls 8k", matmuls),
                     ("100k Python objects", pyobjs)]
    f0 = floor()
    res = {name: [] for name, _ in variants}
    for rep in range(args.reps + 1):
        for name, fn in variants:
            ms = fn()
            if rep:
                res[name].append(ms)
    fl = min(f0, floor())
    mode = "default mode" + (", the model built" if model is not None else "")
    print(f"\n{n} blocks ({nbytes / 1e9:.3f} GB), {mode}, pool {pool // BLOCK} blocks, KV {num_blocks} blocks, "
          f"contiguous H2D floor {fl:.3f} ms "
          f"(best of 5 before and 5 after); median of {args.reps} reps, variants interleaved")
    print("| variant | median ms | min ms | floor / median |")
    print("|---|---:|---:|---:|")
    for name, _ in variants:
        xs = res[name]
        med = statistics.median(xs)
        print(f"| {name} | {med:.3f} | {min(xs):.3f} | {fl / med:.3f} |")
    if args.trace and model is not None:
        from torch.profiler import ProfilerActivity, profile, record_function

        import trace_reload

        def traced(name, prefill):
            if prefill:
                R.prefill(model, prompt)
            torch.cuda.synchronize()
            with record_function(name):
                ms = timed(lambda: eng.load(keys, dst, after=compute), sync=False)
            return ms

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            got = [(f"prefilled-{i}", traced(f"prefilled-{i}", True)) for i in range(3)]
            got += [(f"plain-{i}", traced(f"plain-{i}", False)) for i in range(3)]
        prof.export_chrome_trace(args.trace)
        print("\ntraced loads: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in got))
        print("\n".join(trace_reload.analyse(args.trace, fl)))
    try:
        with open("/proc/self/smaps_rollup") as f:
            huge = [ln.split(None, 1)[1].strip() for ln in f if ln.startswith("AnonHugePages:")]
        print(f"process AnonHugePages: {huge[0] if huge else '?'}")
    except OSError:
        pass
    eng.delete(keys)
    eng.close()


if __name__ == "__main__":
    main()
