"""Engine.connect on the host backend: engines of two processes' worth
(two engines, each with its own simulated GPU) share a node's pool
(`kvoffload serve`, built from this checkout with go, or $KVOFFLOAD_BIN)."""

import os
import shutil
import signal
import subprocess
import tempfile
import unittest

import kvoffload

from .helpers import block_holds, host_config, keys_for, needs_library, write_block

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_binary = None


def node_binary():
    """The kvoffload CLI: $KVOFFLOAD_BIN, else built from the checkout
    (None when neither is possible: outside the source tree, no go)."""
    global _binary
    if _binary is None:
        env = os.environ.get("KVOFFLOAD_BIN")
        if env:
            _binary = env
        elif shutil.which("go") and os.path.exists(os.path.join(REPO, "go.mod")):
            out = os.path.join(tempfile.mkdtemp(prefix="kvo-bin-"), "kvoffload")
            r = subprocess.run(["go", "build", "-o", out, "./cmd/kvoffload"], cwd=REPO, capture_output=True, text=True)
            _binary = out if r.returncode == 0 else ""
        else:
            _binary = ""
    return _binary or None


class Node:
    """A `kvoffload serve` process on a socket in a fresh directory."""

    def __init__(self, socket):
        self.socket = socket
        self.proc = subprocess.Popen([node_binary(), "serve", "--socket", socket, "--pool", "4MiB", "--region", "1MiB",
                                      "--hugetlb=false"], stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "listening" not in line:
            self.stop()
            raise RuntimeError(f"kvoffload serve said {line!r}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


@needs_library
class Connect(unittest.TestCase):
    def setUp(self):
        if node_binary() is None:
            self.skipTest("no kvoffload binary: set KVOFFLOAD_BIN, or run in the source tree with go")
        self.dir = tempfile.mkdtemp(prefix="kvo-node-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.socket = os.path.join(self.dir, "node.sock")
        self.node = Node(self.socket)
        self.addCleanup(lambda: self.node.stop())

    def connect(self, **over):
        eng = kvoffload.Engine.connect(self.socket, **host_config(**over))
        self.addCleanup(eng.close)
        return eng

    def test_store_here_load_there(self):
        a, b = self.connect(), self.connect()
        keys = keys_for(8, 1)
        for i in range(8):
            write_block(a, i, 0)
        with a.store(keys, range(8)) as op:
            self.assertEqual(op.wait(timeout=30), ["stored"] * 8)
        hits, lease = b.lookup(keys, lease=True)
        self.assertEqual(hits, 8)
        with b.load(keys, range(8, 16), lease=lease) as op:
            self.assertEqual(op.wait(timeout=30), ["loaded"] * 8)
        for i in range(8):
            self.assertTrue(block_holds(b, 8 + i, i, 0), f"block {8 + i}")
        with b.load(keys_for(2, 7), [20, 21]) as op:
            self.assertEqual(op.wait(timeout=30), ["missing", "missing"])
        self.assertEqual(b.stats()["pool"]["blocks_ready"], 8)

        # A scheduler: no tensors, no host backend: no GPU.
        cfg = host_config()
        del cfg["backend"]
        sched = kvoffload.Engine.connect(self.socket, **cfg)
        self.addCleanup(sched.close)
        self.assertEqual(sched.lookup(keys), 8)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            sched.store(keys[:1], [0])
        self.assertEqual(sched.delete(keys[:1]), 1)
        self.assertEqual(a.lookup(keys), 0)

    def test_node_gone(self):
        a = self.connect()
        keys = keys_for(4, 2)
        for i in range(4):
            write_block(a, i, 0)
        with a.store(keys, range(4)) as op:
            self.assertEqual(op.wait(timeout=30), ["stored"] * 4)
        self.node.stop()
        self.assertEqual(a.lookup(keys), 0)
        with a.store(keys_for(2, 3), [0, 1]) as op:
            self.assertEqual(op.wait(timeout=30), ["refused-busy"] * 2)
        with self.assertRaises(kvoffload.UnavailableError):
            a.load(keys, range(8, 12))

    def test_no_node(self):
        with self.assertRaises(kvoffload.UnavailableError):
            kvoffload.Engine.connect(os.path.join(self.dir, "nothing.sock"), **host_config())


if __name__ == "__main__":
    unittest.main()
