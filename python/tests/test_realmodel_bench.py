"""The plain-Python part of bench/realmodel.py (block ids, paging, the
results table and targets), without torch or a GPU, so that CI runs it."""

import importlib.util
import os
import random
import subprocess
import sys
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "realmodel.py")


def load():
    spec = importlib.util.spec_from_file_location("realmodel", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class RealModelBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.rm = load()

    def test_selfcheck(self):
        md = self.rm.selfcheck()
        self.assertIn("| tokens | KV GB |", md)

    def test_selfcheck_command_line(self):
        proc = subprocess.run([sys.executable, SCRIPT, "--selfcheck"], capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("selfcheck: ok", proc.stdout)

    def test_round_trip_through_other_ids(self):
        rm = self.rm
        rng = random.Random(3)
        for tokens in (16, 2048, 8192):
            n = rm.blocks_for(tokens)
            src, dst = rm.assign_block_ids(2 * n + 5, n, rng)
            seq = list(range(tokens))
            paged = rm.to_paged(seq, src, 2 * n + 5)
            moved = rm.to_paged(rm.from_paged(paged, src), dst, 2 * n + 5)
            self.assertEqual(rm.from_paged(moved, dst), seq)
            self.assertEqual(rm.paged_slot(tokens - 1, dst), (dst[-1], rm.TPB - 1))

    def test_targets_at_the_bounds(self):
        rm = self.rm
        row = rm.make_row(8192, 257, reload_ms=20.0, load_return_ms=0.5, layer_ms=[0.625 * (l + 1) for l in range(32)],
                          layer_total_ms=20.0, store_ms=20.0, h2d_ms=18.5, d2h_ms=18.1)
        self.assertEqual([ok for ok, _ in rm.targets(row)], [True, True, True])  # 92.5% and 90.5%
        late = dict(row, layer_ms=[0.625 * (l + 1) + (1.01 if l == 7 else 0) for l in range(32)])
        ok, text = rm.targets(late)[2]
        self.assertFalse(ok)
        self.assertIn("first layer 7", text)
        self.assertEqual([ok for ok, _ in rm.targets(dict(row, floor_over_reload=0.919))][:1], [False])


if __name__ == "__main__":
    unittest.main()
