import os
import re
import subprocess
import sys
import tempfile
import unittest

import kvoffload
from kvoffload import _lib

from .helpers import (NUM_BLOCKS, block_holds, have_library, host_config, keys_for, needs_library, small_config,
                      write_block)


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

    def test_store_parent_keeps_chain(self):
        seq, other = keys_for(3, 40), keys_for(1, 41)

        def run(parent):
            with kvoffload.Engine(small_config(3)) as eng:
                self.assertEqual(eng.stats()["pool"]["slots_total"], 3)
                for ks, ids, kw in ((seq[:2], [0, 1], {}), (seq[2:], [2], {"parent": parent}), (other, [3], {})):
                    with eng.store(ks, ids, **kw) as op:
                        self.assertEqual(op.wait(), ["stored"] * len(ks))
                self.assertEqual(eng.stats()["orphans"], 0)
                return eng.lookup(seq)

        self.assertEqual(run(seq[1]), 2, "with parent the sequence's tail is evicted")
        self.assertLess(run(None), 2, "without parent seq[2] is a chain of its own and seq[1] goes first")

    def test_store_parents_mixed_call(self):
        seq, b, c = keys_for(3, 42), keys_for(1, 43)[0], keys_for(1, 44)[0]
        with kvoffload.Engine(small_config(4)) as eng:
            eng.store(seq[:2], [0, 1]).wait()
            with eng.store([b, seq[2]], [3, 2], parents=[None, seq[1]]) as op:
                self.assertEqual(op.wait(), ["stored"] * 2)
            eng.store([c], [4]).wait()
            self.assertGreaterEqual(eng.lookup(seq), 2, "the middle of seq is never evicted")
            self.assertEqual(eng.stats()["orphans"], 0)
            # Packed parents and ZERO_KEY are accepted too.
            with eng.store(keys_for(2, 45), [5, 6], parents=kvoffload.ZERO_KEY + seq[2]) as op:
                op.wait()

    def test_store_parent_bad_input(self):
        eng, keys = self.eng, keys_for(2, 46)
        cases = {
            "parent and parents": lambda: eng.store(keys, [0, 1], parent=keys[0], parents=[None, None]),
            "parent of 15 bytes": lambda: eng.store(keys, [0, 1], parent=b"x" * 15),
            "fewer parents": lambda: eng.store(keys, [0, 1], parents=[None]),
            "more packed parents": lambda: eng.store(keys, [0, 1], parents=bytes(48)),
            "key its own parent": lambda: eng.store(keys, [0, 1], parents=[keys[0], None]),
            "parent not bytes": lambda: eng.store(keys, [0, 1], parents=[None, "k" * 16]),
        }
        for name, f in cases.items():
            with self.subTest(name), self.assertRaises(kvoffload.InvalidArgumentError):
                f()
        self.assertEqual(eng.lookup(keys), 0, "nothing stored by a refused call")

    def test_backend_and_device(self):
        self.assertEqual(self.eng.backend, "host")
        self.assertEqual(self.eng.device, 0)
        self.assertEqual(self.eng.config["device"], 0)  # present although zero
        self.assertTrue(self.eng.backend_reason)
        cfg = host_config()
        del cfg["backend"]  # auto: the host backend without a GPU, reported as such
        try:
            eng = kvoffload.Engine(cfg)
        except kvoffload.KvoError as e:
            self.skipTest(f"backend auto refused here: {e}")
        with eng:
            self.assertIn(eng.backend, ("host", "cuda"))
            self.assertEqual(eng.config["backend"], eng.backend)
            self.assertEqual(eng.stats()["backend"], eng.backend)
            self.assertTrue(eng.backend_reason)

    def test_growth_pause_wait_resume(self):
        cfg = small_config(1, pool_bytes=256 << 20, first_region_bytes=1 << 20, region_bytes=1 << 20)
        with kvoffload.Engine(cfg) as eng:
            eng.pause_growth()
            eng.pause_growth()  # idempotent
            self.assertTrue(eng.stats()["pool"]["growth_paused"])
            self.assertFalse(eng.wait_grown(0))
            self.assertFalse(eng.wait_grown(0.03))
            st = eng.stats()
            self.assertLess(st["pool"]["regions"], st["pool"]["regions_total"])
            eng.resume_growth()
            self.assertFalse(eng.stats()["pool"]["growth_paused"])
            self.assertTrue(eng.wait_grown())
            self.assertTrue(eng.wait_grown(0))
            st = eng.stats()
            self.assertEqual(st["pool"]["regions"], st["pool"]["regions_total"])
        for f in (eng.wait_grown, eng.pause_growth, eng.resume_growth):
            with self.assertRaises(kvoffload.EngineClosedError):
                f()

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

    def test_abi_version_matches_header(self):
        header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "capi", "kvoffload.h")
        if not os.path.exists(header):
            self.skipTest("no capi/kvoffload.h next to the package")
        with open(header) as f:
            m = re.search(r"^#define KVO_ABI_VERSION (\d+)$", f.read(), re.M)
        self.assertIsNotNone(m)
        self.assertEqual(int(m.group(1)), _lib.ABI_VERSION, "kvoffload.h and _lib.ABI_VERSION disagree")
        if have_library():
            self.assertEqual(kvoffload.abi_version(), _lib.ABI_VERSION)

    @unittest.skipUnless(subprocess.run(["which", "gcc"], capture_output=True).returncode == 0, "no gcc")
    def test_other_abi_version(self):
        with tempfile.TemporaryDirectory() as d:
            src, so = os.path.join(d, "fake.c"), os.path.join(d, "libfake.so")
            for other in (99, _lib.ABI_VERSION - 1):
                lib = os.path.join(d, f"libfake{other}.so")  # a new name: the loader caches by name
                with open(src, "w") as f:
                    f.write(f"int kvo_abi_version(void) {{ return {other}; }}\n")
                subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, src], check=True)
                with self.assertRaises(kvoffload.AbiVersionError) as cm:
                    _lib.load_library(lib)
                self.assertIn(f"ABI version {other}", str(cm.exception))
                self.assertIn("rebuild", str(cm.exception))
            with open(src, "w") as f:
                f.write("int not_kvoffload(void) { return 1; }\n")
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", so, src], check=True)
            with self.assertRaises(kvoffload.AbiVersionError):
                _lib.load_library(so)


@needs_library
class EnvironmentSwitches(unittest.TestCase):
    def test_set_after_the_library_loaded(self):
        # A KVOFFLOAD_* switch set through os.environ after the library
        # loaded reaches the next engine (Go keeps its own copy of the
        # environment from the process's start; the C ABI brings the
        # current switches into it when it makes an engine), a bad value
        # is refused by name, and one removed is gone again.
        pkg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        code = """
import os, sys
sys.path.insert(0, os.path.join(%r, "tests"))
import kvoffload
from helpers import host_config, keys_for
kvoffload.Engine(host_config()).close()  # the library is loaded
os.environ["KVOFFLOAD_TRACE_CALLS"] = "x"
try:
    kvoffload.Engine(host_config())
    print("bad value accepted")
except kvoffload.KvoError as e:
    print("refused:", "KVOFFLOAD_TRACE_CALLS" in str(e))
os.environ["KVOFFLOAD_TRACE_CALLS"] = "1"
eng = kvoffload.Engine(host_config())
eng.store(keys_for(2, 1), [0, 1]).wait()
eng.close()
del os.environ["KVOFFLOAD_TRACE_CALLS"]
eng = kvoffload.Engine(host_config())
eng.store(keys_for(2, 2), [2, 3]).wait()
eng.close()
""" % pkg
        env = dict(os.environ)
        env.pop("KVOFFLOAD_TRACE_CALLS", None)
        env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
        out = subprocess.run([sys.executable, "-c", code], cwd=pkg, env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.split(), ["refused:", "True"])
        traced = [ln for ln in out.stderr.splitlines() if ln.startswith("kvoffload trace: ")]
        self.assertEqual(len(traced), 1, out.stderr)
        self.assertIn("Store of 2 blocks", traced[0])


if __name__ == "__main__":
    unittest.main()
