"""The plain-Python part of bench/transformers_cb.py (workloads, the ideal
prefill, token comparisons, the table and its targets), without torch or
a GPU, so that CI runs it."""

import os
import subprocess
import sys
import unittest

from .helpers import REPO, load_script

SCRIPT = os.path.join(REPO, "bench", "transformers_cb.py")


def load():
    return load_script(SCRIPT)


@unittest.skipUnless(os.path.exists(SCRIPT), "no bench/transformers_cb.py beside the tests")
class TransformersCBBench(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.b = load()

    def test_selfcheck(self):
        md = self.b.selfcheck()
        self.assertIn("| workload | model | mode |", md)

    def test_selfcheck_command_line(self):
        proc = subprocess.run([sys.executable, SCRIPT, "--selfcheck"], capture_output=True, text=True, timeout=60)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("selfcheck: ok", proc.stdout)

    def test_issue_numbers(self):
        b = self.b
        wl = b.WORKLOADS["prefix"]
        # 64 requests over 4 prefixes of 4096 tokens + 256 of their own: 32,768 ideal,
        # and the issue's 48,128 (15 of 16 blocks matched) is +46.9%.
        self.assertEqual(b.ideal_prefill(**wl), 32768)
        self.assertAlmostEqual(b.pct(48128, 32768), 46.875)
        # The GPU cache of the comparison runs cannot hold the four prefixes; the reference's never evicts.
        self.assertLess(wl["num_blocks"], 4 * 4096 // b.BLOCK)
        self.assertGreaterEqual(b.ref_blocks(**wl), 4 * 16 + 64 * 2)

    def test_workload_is_interleaved_and_deterministic(self):
        b = self.b
        w1 = b.make_workload(vocab=1000, seed=5, **b.WORKLOADS["preempt"])
        w2 = b.make_workload(vocab=1000, seed=5, **b.WORKLOADS["preempt"])
        self.assertEqual(w1, w2)
        self.assertEqual(len({rid for rid, _, _ in w1}), len(w1))
        self.assertTrue(all(10 <= t < 1000 for _, toks, _ in w1 for t in toks))
        self.assertEqual([p for _, _, p in w1[:4]], [0, 1, 0, 1])

    def test_targets_fail(self):
        b = self.b
        rows = [b.fake_row("prefix", "8b", "kvo", prefill_tokens=35000, ideal=32768),
                b.fake_row("preempt", "small", "share", victims=4, soft_resets=4),
                b.fake_row("preempt", "small", "kvo", victims=4, soft_resets=4, keys_stored_twice=2, kvo_stored=9)]
        got = b.targets(rows)
        # preempt: wall and TTFT as alone's (pass), copied twice (fail), preempted 4 (pass), as many soft
        # resets as alone (fail); prefix (fail, and no time targets without a share row)
        self.assertEqual([ok for ok, _ in got], [True, True, False, True, False, False])
        self.assertIn("+6.8%", got[5][1])
        text = b.format_targets(got)
        self.assertEqual(text.count("- FAIL:"), 3)
        # A kvo run 4% slower than transformers alone fails its time target.
        slow = b.targets([rows[1], dict(rows[2], wall_s=1.04)])
        self.assertFalse(slow[0][0])
        self.assertIn("1.040x", slow[0][1])

    def test_compare_divergence_at_length_difference(self):
        eq, n, div, miss = self.b.compare({"a": [1, 2, 3]}, {"a": [1, 2]})
        self.assertEqual((eq, n, div, miss), (0, 1, [("a", 2)], []))


if __name__ == "__main__":
    unittest.main()
