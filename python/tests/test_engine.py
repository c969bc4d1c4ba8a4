import os
import subprocess
import tempfile
import unittest

import kvoffload
from kvoffload import _lib

from .helpers import NUM_BLOCKS, block_holds, host_config, keys_for, needs_library, write_block


@needs_library
class HostEngine(unittest.TestCase):
    def setUp(self):
        self.eng = kvoffload.Engine(host_config())
        self.addCleanup(self.eng.close)

    def test_round_trip(self):
        eng = self.eng
        keys = keys_for(8, 1)
        for b in range(8):
            write_block(eng, b, 0)
        with eng.store(keys, range(8)) as op:
            self.assertEqual(op.wait(), ["stored"] * 8)
            self.assertTrue(op.done())
            self.assertEqual(op.event(), 0)
            op.wait_stream(None)
        with eng.store(keys, list(range(8))) as op:
            self.assertEqual(op.wait(), ["already-present"] * 8)
        self.assertEqual(eng.lookup(keys), 8)
        self.assertEqual(eng.lookup(keys[:3] + keys_for(1, 9)), 3)
        for b in range(8):
            write_block(eng, b, 99)  # overwrite the GPU cache
        hits, lease = eng.lookup(keys, lease=True)
        self.assertEqual(hits, 8)
        with eng.load(keys, range(8, 16), lease=lease, per_layer=True) as op:
            self.assertEqual(op.wait(timeout=30), ["loaded"] * 8)
            op.layer_event(1)
        with self.assertRaises(kvoffload.ReleasedError):
            lease.release()  # taken over by the load
        for b in range(8):
            self.assertTrue(block_holds(eng, 8 + b, b, 0), f"block {8 + b}")
        with eng.load(keys_for(2, 7), [20, 21]) as op:
            self.assertEqual(op.wait(), ["missing", "missing"])
        self.assertEqual(eng.delete(keys[:2]), 2)
        self.assertEqual(eng.lookup(keys), 0)
        self.assertEqual(eng.clear(), 6)

    def test_lease_release_and_context(self):
        keys = keys_for(2, 2)
        self.eng.store(keys, [0, 1]).wait()
        hits, lease = self.eng.lookup(keys, lease=True)
        with lease:
            self.assertEqual(hits, 2)
        with self.assertRaises(kvoffload.ReleasedError):
            lease.release()
        self.assertEqual(self.eng.lookup(keys_for(1, 3), lease=True), (0, None))

    def test_stats_trim_staging(self):
        st = self.eng.stats()
        self.assertEqual(st["backend"], "host")
        self.assertIn("outcomes", st)
        self.assertEqual(self.eng.trim(0), {"freed_bytes": 0, "pending_bytes": 0})
        s = self.eng.staging("ids", 64)
        buf = s.buffer()
        buf[:4] = b"abcd"
        self.assertEqual(self.eng.staging("ids", 64).ptr, s.ptr)
        self.assertEqual(bytes(self.eng.staging("ids", 64).buffer()[:4]), b"abcd")
        with self.assertRaises(kvoffload.InvalidArgumentError):
            self.eng.staging("ids", 128)
        with self.assertRaises(kvoffload.OutOfMemoryError):
            self.eng.staging("big", 1 << 30)

    def test_keys_helper(self):
        toks = list(range(4 * 3 + 2))
        self.assertEqual(self.eng.keys(toks), kvoffload.chain_keys(toks, 4, namespace="py-test"))

    def test_bad_input(self):
        eng = self.eng
        keys = keys_for(2, 4)
        cases = {
            "short key": lambda: eng.store([b"x" * 15, keys[1]], [0, 1]),
            "key of wrong type": lambda: eng.lookup(["0" * 16]),
            "packed keys not multiple": lambda: eng.lookup(b"x" * 17),
            "fewer block ids": lambda: eng.store(keys, [0]),
            "block id out of range": lambda: eng.store(keys, [0, NUM_BLOCKS]),
            "negative block id": lambda: eng.load(keys, [-1, 0]),
            "duplicate block id": lambda: eng.store(keys, [3, 3]),
            "block id not int": lambda: eng.store(keys, [0, "a"]),
            "lease of wrong type": lambda: eng.load(keys, [0, 1], lease=5),
            "sim outside memory": lambda: eng.sim_write(1, b"abc"),
            "config not a dict": lambda: kvoffload.Engine("{}"),
            "unknown config field": lambda: kvoffload.Engine(host_config(no_such=1)),
            "bad pool size": lambda: kvoffload.Engine(host_config(pool_bytes=-1)),
            "bad layout": lambda: kvoffload.Engine(host_config(layout={"kind": "nope"})),
        }
        for name, f in cases.items():
            with self.subTest(name), self.assertRaises(kvoffload.InvalidArgumentError) as cm:
                f()
            self.assertTrue(str(cm.exception), name)
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            eng.store(keys, [0, NUM_BLOCKS])
        self.assertIn(str(NUM_BLOCKS), str(cm.exception))  # the C text names the limit
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            kvoffload.Engine(host_config(no_such=1))
        self.assertIn("no_such", str(cm.exception))

    def test_released_op_and_closed_engine(self):
        op = self.eng.store(keys_for(1, 5), [0])
        op.release()
        for f in (op.wait, op.outcomes, op.release, op.done):
            with self.assertRaises(kvoffload.ReleasedError):
                f()
        eng = kvoffload.Engine(host_config())
        eng.close()
        eng.close()  # idempotent
        self.assertTrue(eng.closed)
        with self.assertRaises(kvoffload.EngineClosedError):
            eng.lookup(keys_for(1, 5))

    def test_cuda_backend_refused(self):
        # Backend "cuda" with addresses that are not device memory is always
        # refused: without a driver as NoDriverError, with one because the
        # engine checks every tensor's extent against the driver.
        cfg = host_config(backend="cuda")
        cfg["layout"] = dict(cfg["layout"], layer_tensors=[{"k": 4096, "v": 1 << 20, "stride": 512}] * 2)
        with self.assertRaises((kvoffload.NoDriverError, kvoffload.InvalidArgumentError)) as cm:
            kvoffload.Engine(cfg).close()
        if isinstance(cm.exception, kvoffload.InvalidArgumentError):
            self.assertIn("not device memory", str(cm.exception))
        else:
            self.assertIn("libcuda", str(cm.exception))


class Library(unittest.TestCase):
    def test_missing_library(self):
        with self.assertRaises(kvoffload.LibraryError) as cm:
            _lib.load_library("/nonexistent/libkvoffload.so")
        self.assertIn("capi/build.sh", str(cm.exception))

    @unittest.skipUnless(subprocess.run(["which", "gcc"], capture_output=True).returncode == 0, "no gcc")
    def test_other_abi_version(self):
        with tempfile.TemporaryDirectory() as d:
            src, so = os.path.join(d, "fake.c"), os.path.join(d, "libfake.so")
            with open(src, "w") as f:
                f.write("int kvo_abi_version(void) { return 99; }\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", so, src], check=True)
            with self.assertRaises(kvoffload.AbiVersionError) as cm:
                _lib.load_library(so)
            self.assertIn("99", str(cm.exception))
            with open(src, "w") as f:
                f.write("int not_kvoffload(void) { return 1; }\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", so, src], check=True)
            with self.assertRaises(kvoffload.AbiVersionError):
                _lib.load_library(so)


if __name__ == "__main__":
    unittest.main()
