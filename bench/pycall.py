"""Where a Python load() of many blocks spends its time (issue 21's "the
Python call's time reported beside" Go's): no model, the real-model
benchmark's KV geometry (32 layers, 8 KV heads of 128, 16-token bf16
blocks: 2 MiB a block) on the GPU, blocks stored from random
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

With --trace the engine traces its calls (KVOFFLOAD_TRACE_CALLS, lines on
stderr, read back here) and a second table splits each kind of call on one
clock (CLOCK_MONOTONIC): from the Python call to Go's Engine entry (the
package's checks, ctypes, cgo, the C ABI's copies of the arguments), then
Go's points (checked, looked up, planned, submitted, the head's first copy
enqueued, the events promised), Go's return, and the Python call's.

Usage: KVOFFLOAD_LIB=... PYTHONPATH=python python3 bench/pycall.py [--blocks 128 2048] [--reps 9] [--trace]
"""

import argparse
import atexit
import ctypes
import os
import re
import tempfile
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
    ap.add_argument("--trace", action="store_true", help="split the calls with the engine's trace (see above)")
    args = ap.parse_args(argv)
    tracer = CallTrace() if args.trace else None
    if tracer is not None:
        tracer.start()
    tr = tracer.mark if tracer is not None else (lambda *a: None)

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
                                        policy="lru")
    eng.wait_grown()
    lib = _lib.get()
    compute = torch.cuda.current_stream()
    rng = random.Random(1)
    rows = []
    for n in args.blocks:
        ids = rng.sample(range(num_blocks), 2 * n)
        src, dst = ids[:n], ids[n:]
        keys = kvoffload.chain_keys(range(rng.randrange(1 << 30), 0, -1)[:n * TPB], TPB, namespace="pycall")
        tr(None, "store", n)
        op = eng.store(keys, src, after=compute)
        tr(op)
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
            tr(None, "load(lists)", n, rep)
            op = eng.load(keys, dst, after=compute)
            tr(op)
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
            tr(None, "load(lists, per_layer)", n, rep)
            op = eng.load(keys, dst, after=compute, per_layer=True)
            tr(op)
            op.wait_layer(0, compute)
            l0.record(compute)
            op.wait_stream(compute)
            l0.synchronize()
            layer0.append(s.elapsed_time(l0))
            op.wait()
            op.release()

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            tr(None, "load(packed)", n, rep)
            op = eng.load(raw_keys, raw_ids, after=compute)
            tr(op)
            packed.append((time.perf_counter() - t0) * 1e3)
            op.wait()
            op.release()

            torch.cuda.synchronize()
            o = ctypes.c_uint64(0)
            t0 = time.perf_counter()
            tr(None, "raw kvo_load", n, rep)
            rc = lib.kvo_load(eng._h(), E._addr(raw_keys), E._addr(raw_ids), n, 0, 0, 0, 0, ctypes.byref(o))
            tr(o)
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
    if tracer is not None:
        tracer.report()


class CallTrace:
    """The engine's call trace (KVOFFLOAD_TRACE_CALLS, one stderr line per
    Store/Load) beside this process's own clock: start() turns it on and
    sends fd 2 to a file before the engine exists; mark(None, label, n,
    rep) before a call and mark(result) after it note CLOCK_MONOTONIC;
    report() matches the lines to the calls in order and prints the
    medians of each kind's points (warm-up rep 0 left out)."""

    POINTS = ("checked", "load", "begun", "planned", "submit", "head", "copy0", "promised")

    def __init__(self):
        self.calls = []  # [label, n, rep, t0, t1]
        self.file = None
        self.saved = None

    def start(self):
        # Read when the engine is made (the C ABI reads the switches
        # with C's getenv: os.environ's changes count).
        os.environ["KVOFFLOAD_TRACE_CALLS"] = "1000000"
        self.file = tempfile.TemporaryFile(mode="w+b")
        sys.stderr.flush()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        atexit.register(self.restore)  # a failure's traceback reaches the real stderr

    def restore(self):
        """Gives fd 2 back and returns what was written to it meanwhile."""
        if self.saved is None:
            return ""
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.saved = None
        self.file.seek(0)
        text = self.file.read().decode(errors="replace")
        sys.stderr.write("".join(ln + "\n" for ln in text.splitlines() if not ln.startswith("kvoffload trace: ")))
        sys.stderr.flush()
        return text

    def mark(self, result, label=None, n=0, rep=1):
        now = time.monotonic_ns()
        if result is None and label is not None:
            self.calls.append([label, n, rep, now, None])
        else:
            self.calls[-1][4] = now

    def report(self):
        text = self.restore()
        lines = [ln for ln in text.splitlines() if ln.startswith("kvoffload trace: ")]
        pat = re.compile(r"kvoffload trace: (\w+) of (\d+) blocks entered at (\d+) ns \(CLOCK_MONOTONIC\), "
                         r"returned after ([0-9.]+) ms(?: \(error: .*\))?:(.*) \(ms from the call's entry\)$")
        parsed = []
        for ln in lines:
            m = pat.match(ln)
            if not m:
                raise RuntimeError(f"pycall: a trace line not understood: {ln[:200]}")
            words = m.group(5).split()
            points = {words[i]: float(words[i + 1]) for i in range(0, len(words) - 1, 2)}
            parsed.append((m.group(1), int(m.group(2)), int(m.group(3)), float(m.group(4)), points))
        if len(parsed) != len(self.calls):
            raise RuntimeError(f"pycall: {len(parsed)} trace lines for {len(self.calls)} calls")
        rows = {}
        for (label, n, rep, t0, t1), (kind, gn, entry, ret, points) in zip(self.calls, parsed):
            if gn != n or (kind == "Store") != (label == "store"):
                raise RuntimeError(f"pycall: trace line {kind} of {gn} does not match the call {label} of {n}")
            if rep == 0 or t1 is None:
                continue
            before = (entry - t0) / 1e6
            row = rows.setdefault((label, n), {"before Go": [], "Go returned": [], "Python returned": []})
            row["before Go"].append(before)
            for p in self.POINTS:
                if p in points:
                    row.setdefault(p, []).append(before + points[p])
            row["Go returned"].append(before + ret)
            row["Python returned"].append((t1 - t0) / 1e6)
        cols = ["before Go", *self.POINTS, "Go returned", "Python returned"]
        print("\nThe calls on one clock (KVOFFLOAD_TRACE_CALLS): medians, ms from the Python call")
        print("| call | blocks | " + " | ".join(cols) + " |")
        print("|---|---:|" + "---:|" * len(cols))
        for (label, n), row in rows.items():
            cells = [f"{statistics.median(row[c]):.3f}" if c in row else "–" for c in cols]
            print(f"| {label} | {n} | " + " | ".join(cells) + " |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
