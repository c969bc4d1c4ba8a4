"""GPU tests (H200, torch): a KV cache shaped like an 8B model's (32 layers,
8 KV heads, head dim 128, 16 tokens per block, bf16), written by torch on a
side stream, stored ordered by the stream argument alone, overwritten,
loaded into other block ids and compared block by block; the same without
the ordering must show the race; SIGINT during GPU transfers.

Skipped without torch or a GPU; with KVO_REQUIRE_GPU=1 a skip is a failure.
"""

import os
import subprocess
import sys
import textwrap
import time
import unittest

import kvoffload

from .gpuhelpers import gpu_test, torch


LAYERS, HEADS, DIM, TPB = 32, 8, 128, 16
N = int(os.environ.get("KVO_GPU_BLOCKS", "2048"))  # blocks stored per test (2 MiB each)
BLOCK_BYTES = LAYERS * 2 * TPB * HEADS * DIM * 2
SLEEP_CYCLES = int(2e9)  # ~1 s of torch.cuda._sleep before the fill: the fill finishes late


def results(name, nbytes, seconds):
    print(f"  {name:<34} {nbytes / 2**30:7.2f} GiB {seconds * 1e3:9.1f} ms {nbytes / seconds / 1e9:7.1f} GB/s",
          file=sys.stderr)


@gpu_test
class LayerSeparate(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.kv = [(torch.zeros(2 * N, TPB, HEADS, DIM, dtype=torch.bfloat16, device="cuda"),
                   torch.zeros(2 * N, TPB, HEADS, DIM, dtype=torch.bfloat16, device="cuda")) for _ in range(LAYERS)]
        pool = (N + 64) * BLOCK_BYTES
        cls.eng = kvoffload.Engine.from_tensors(cls.kv, pool_bytes=pool, first_region_bytes=pool,
                                                namespace="llama-8b/bf16/tp0", policy="lru")
        cls.side = torch.cuda.Stream()
        cls.seq = 0

    @classmethod
    def tearDownClass(cls):
        cls.eng.close()
        del cls.kv
        torch.cuda.empty_cache()

    def fresh_keys(self):
        type(self).seq += 1
        return self.eng.keys(range(self.seq << 24, (self.seq << 24) + N * TPB))

    def fill_late(self):
        """On the side stream: a ~1 s spin, then random bits into blocks
        0..N-1, then a copy of them (the reference). Returns the reference;
        nothing is synchronized."""
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(SLEEP_CYCLES)
            ref = []
            for k, v in self.kv:
                for t in (k, v):
                    t[:N].view(torch.int16).random_(-32768, 32767)
                ref.append((k[:N].clone(), v[:N].clone()))
        return ref

    def mismatched_blocks(self, ref):
        """Blocks N..2N-1 compared with the reference, bit for bit."""
        bad = torch.zeros(N, dtype=torch.bool, device="cuda")
        for (k, v), (rk, rv) in zip(self.kv, ref):
            for t, r in ((k, rk), (v, rv)):
                bad |= (t[N:2 * N].view(torch.int16) != r.view(torch.int16)).view(N, -1).any(dim=1)
        return int(bad.sum())

    def round_trip(self, ordered):
        cur = torch.cuda.current_stream()
        ref = self.fill_late()
        keys = self.fresh_keys()
        t0 = time.perf_counter()
        store = self.eng.store(keys, range(N), after=self.side if ordered else None)
        self.assertEqual(store.wait(), ["stored"] * N)
        t_store = time.perf_counter() - t0
        # The side stream overwrites the GPU blocks only after the store.
        store.wait_stream(self.side)
        with torch.cuda.stream(self.side):
            for k, v in self.kv:
                k[:2 * N].zero_()
                v[:2 * N].zero_()
        store.release()
        hits, lease = self.eng.lookup(keys, lease=True)
        self.assertEqual(hits, N)
        t0 = time.perf_counter()
        with self.eng.load(keys, range(N, 2 * N), lease=lease, after=self.side, per_layer=True) as load:
            for layer in range(LAYERS):
                load.wait_layer(layer, cur)
            load.wait_stream(cur)
            self.assertEqual(load.wait(), ["loaded"] * N)
            t_load = time.perf_counter() - t0
            bad = self.mismatched_blocks(ref)
        torch.cuda.synchronize()
        self.eng.delete(keys)
        return bad, t_store, t_load

    def test_ordered_by_stream_argument(self):
        bad, t_store, t_load = self.round_trip(ordered=True)
        self.assertEqual(bad, 0, f"{bad} of {N} blocks differ after store/overwrite/load")
        results(f"store {N} blocks (incl. ~1 s wait)", N * BLOCK_BYTES, t_store)
        results(f"load {N} blocks", N * BLOCK_BYTES, t_load)

    def test_unordered_race_detected(self):
        bad, _, _ = self.round_trip(ordered=False)
        self.assertGreater(bad, 0, "without the stream argument the copies should have read the blocks "
                                   "before the late fill; the comparison cannot detect a missing ordering")
        print(f"  unordered store: {bad} of {N} blocks differ (expected > 0)", file=sys.stderr)

    def test_stats(self):
        st = self.eng.stats()
        self.assertEqual(st["backend"], "cuda")
        self.assertEqual(st["pool"]["block_bytes"], BLOCK_BYTES)


@gpu_test
class CrossLayer(unittest.TestCase):
    def test_round_trip(self):
        n = 256
        cache = torch.empty(2 * n, LAYERS, 2, TPB, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
        cache.view(torch.int16).random_(-32768, 32767)
        ref = cache[:n].clone()
        pool = (n + 8) * BLOCK_BYTES
        with kvoffload.Engine.from_tensors(cache, pool_bytes=pool, first_region_bytes=pool) as eng:
            keys = eng.keys(range(n * TPB))
            with eng.store(keys, range(n), after=torch.cuda.current_stream()) as op:
                self.assertEqual(op.wait(), ["stored"] * n)
                op.wait_stream(torch.cuda.current_stream())
            cache.zero_()
            with eng.load(keys, range(n, 2 * n), after=torch.cuda.current_stream()) as op:
                op.wait_stream(torch.cuda.current_stream())
                self.assertTrue(torch.equal(cache[n:].view(torch.int16), ref.view(torch.int16)))


SIGINT_SCRIPT = textwrap.dedent("""
    import os, signal, threading, torch, kvoffload
    n = 512
    kv = [(torch.randn(2 * n, 16, 8, 128, dtype=torch.bfloat16, device="cuda"),
           torch.randn(2 * n, 16, 8, 128, dtype=torch.bfloat16, device="cuda")) for _ in range(32)]
    pool = (n + 8) * 32 * 2 * 16 * 8 * 128 * 2
    eng = kvoffload.Engine.from_tensors(kv, pool_bytes=pool, first_region_bytes=pool)
    cur = torch.cuda.current_stream()
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    rounds = 0
    try:
        while True:
            keys = eng.keys(range(rounds << 20, (rounds << 20) + n * 16))
            with eng.store(keys, range(n), after=cur) as op:
                op.wait()
            with eng.load(keys, range(n, 2 * n), after=cur) as op:
                op.wait_stream(cur)
                op.wait()
            eng.delete(keys)
            rounds += 1
    except KeyboardInterrupt:
        pass
    timer.join()
    torch.cuda.synchronize()
    eng.close()
    print("sigint handled after", rounds, "rounds")
""")


@gpu_test
class Signals(unittest.TestCase):
    def test_sigint_during_gpu_transfers(self):
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.run([sys.executable, "-c", SIGINT_SCRIPT], cwd=here, capture_output=True, text=True,
                              timeout=300)
        self.assertEqual(proc.returncode, 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        self.assertIn("sigint handled", proc.stdout)
        print(f"  {proc.stdout.strip()}", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
