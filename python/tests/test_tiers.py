"""Engine.prefetch and the lower tiers' config sections ("disk",
"cluster") through the library, on the host backend: a disk tier found
again by a second engine on the same directory (a restart), promoted by
prefetch and by load; a cluster that does not answer; bad arguments."""

import shutil
import tempfile
import time
import unittest

import kvoffload

from .helpers import block_holds, keys_for, needs_library, small_config, write_block

POOL_BLOCKS = 4


def disk_config(directory, **over):
    return small_config(POOL_BLOCKS, disk=dict({"dirs": [directory], "capacity_bytes": 1 << 20, "admit_all": True},
                                               **over))


@needs_library
class DiskTier(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvo-py-disk-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def write_back(self, keys):
        """An engine stores keys, then as many other blocks as its pool
        holds (evicting keys onto disk), and closes (writing back what is
        queued)."""
        with kvoffload.Engine(disk_config(self.dir)) as eng:
            for b in range(POOL_BLOCKS):
                write_block(eng, b, 5)
            with eng.store(keys, range(len(keys))) as op:
                self.assertEqual(op.wait(), ["stored"] * len(keys))
            with eng.store(keys_for(POOL_BLOCKS, 8), range(POOL_BLOCKS)) as op:
                self.assertEqual(op.wait(), ["stored"] * POOL_BLOCKS)
            self.assertEqual(eng.lookup(keys), 0)
            st = eng.stats()
            self.assertEqual(st["disk"]["dropped"], 0)
            self.assertEqual(st["disk"]["not_admitted"], 0)

    def test_prefetch_after_restart(self):
        keys = keys_for(POOL_BLOCKS, 1)
        self.write_back(keys)
        with kvoffload.Engine(disk_config(self.dir)) as eng:
            self.assertEqual(eng.stats()["disk"]["records"], POOL_BLOCKS)
            self.assertEqual(eng.lookup(keys), 0)
            self.assertEqual(eng.prefetch(keys), {"promoted": POOL_BLOCKS, "from_disk": POOL_BLOCKS, "from_cluster": 0})
            self.assertEqual(eng.lookup(keys), POOL_BLOCKS)
            self.assertEqual(eng.prefetch(keys), {"promoted": 0, "from_disk": 0, "from_cluster": 0})  # held already
            with eng.load(keys, range(4, 4 + POOL_BLOCKS)) as op:
                self.assertEqual(op.wait(), ["loaded"] * POOL_BLOCKS)
            for b in range(POOL_BLOCKS):
                self.assertTrue(block_holds(eng, 4 + b, b, 5), f"block {4 + b}")
            self.assertEqual(eng.stats()["disk"]["hits"], POOL_BLOCKS)

    def test_prefetch_background(self):
        keys = keys_for(POOL_BLOCKS, 3)
        self.write_back(keys)
        with kvoffload.Engine(disk_config(self.dir)) as eng:
            self.assertEqual(eng.prefetch(keys, background=True), {"started": True})
            deadline = time.monotonic() + 10
            while eng.lookup(keys) < POOL_BLOCKS and time.monotonic() < deadline:
                time.sleep(0.005)
            self.assertEqual(eng.lookup(keys), POOL_BLOCKS, "promoted in the background")
            st = eng.stats()
            self.assertEqual(st["prefetch_background"], 1)
            self.assertEqual(st["prefetch_background_promoted"], POOL_BLOCKS)
            with eng.load(keys, range(4, 4 + POOL_BLOCKS)) as op:
                self.assertEqual(op.wait(), ["loaded"] * POOL_BLOCKS)
            for b in range(POOL_BLOCKS):
                self.assertTrue(block_holds(eng, 4 + b, b, 5), f"block {4 + b}")

    def test_load_promotes(self):
        keys = keys_for(POOL_BLOCKS, 2)
        self.write_back(keys)
        with kvoffload.Engine(disk_config(self.dir)) as eng:
            with eng.load(keys, range(4, 4 + POOL_BLOCKS)) as op:
                self.assertEqual(op.wait(), ["loaded"] * POOL_BLOCKS)
            for b in range(POOL_BLOCKS):
                self.assertTrue(block_holds(eng, 4 + b, b, 5), f"block {4 + b}")
            self.assertEqual(eng.stats()["disk"]["hits"], POOL_BLOCKS)

    def test_directory_locked(self):
        with kvoffload.Engine(disk_config(self.dir)):
            with self.assertRaises(kvoffload.KvoError) as cm:
                kvoffload.Engine(disk_config(self.dir))
            self.assertIn(self.dir, str(cm.exception))

    def test_bad_disk_config(self):
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            kvoffload.Engine(disk_config(self.dir, capacity_bytes=0))
        self.assertIn("apacity", str(cm.exception))
        with self.assertRaises(kvoffload.InvalidArgumentError):
            kvoffload.Engine(disk_config(self.dir, fsync="sometimes"))


@needs_library
class Prefetch(unittest.TestCase):
    def test_without_tiers(self):
        with kvoffload.Engine(small_config(POOL_BLOCKS)) as eng:
            self.assertEqual(eng.prefetch(keys_for(3, 1)), {"promoted": 0, "from_disk": 0, "from_cluster": 0})
            self.assertEqual(eng.prefetch([]), {"promoted": 0, "from_disk": 0, "from_cluster": 0})

    def test_cluster_not_answering(self):
        # Nothing listens on port 1: the engine opens, serves from memory
        # and counts the keys it could not ask for.
        cfg = small_config(POOL_BLOCKS, cluster={"addrs": ["127.0.0.1:1"], "timeout": 50_000_000})
        with kvoffload.Engine(cfg) as eng:
            res = eng.prefetch(keys_for(3, 1), timeout=0.05)
            self.assertEqual(res, {"promoted": 0, "from_disk": 0, "from_cluster": 0})
            st = eng.stats()
            self.assertTrue(st["cluster"]["configured"])
            self.assertEqual(st["cluster"]["unavailable"], 3)

    def test_bad_arguments(self):
        eng = kvoffload.Engine(small_config(POOL_BLOCKS))
        for bad in (-1, 0, float("nan")):
            with self.assertRaises(kvoffload.InvalidArgumentError, msg=repr(bad)) as cm:
                eng.prefetch(keys_for(1, 1), timeout=bad)
            self.assertIn("timeout", str(cm.exception))
        with self.assertRaises(kvoffload.ArgumentTypeError):
            eng.prefetch(keys_for(1, 1), timeout="1s")
        with self.assertRaises(kvoffload.InvalidArgumentError):
            eng.prefetch([b"short"])
        eng.close()
        with self.assertRaises(kvoffload.EngineClosedError):
            eng.prefetch(keys_for(1, 1))


if __name__ == "__main__":
    unittest.main()
