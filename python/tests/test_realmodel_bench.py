"""The plain-Python part of bench/realmodel.py (block ids, paging, the
results table and targets), without torch or a GPU, so that CI runs it."""

import os
import random
import subprocess
import sys
import unittest

from .helpers import REPO, load_script

SCRIPT = os.path.join(REPO, "bench", "realmodel.py")


def load():
    return load_script(SCRIPT)


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
        # C = 19.2 ms: layer l's bound is 0.6 (l+1) + 0.75 ms.
        row = rm.make_row(8192, 257, reload_ms=20.0, load_return_ms=1.5, layer_ms=[0.6 * (l + 1) + 0.749 for l in range(32)],
                          layer_total_ms=20.0, store_ms=20.0, h2d_ms=19.2, d2h_ms=18.5, first={"store_ms": 24.0},
                          store_call_ms=1.5, wait0_ms=1.0)
        self.assertEqual([ok for ok, _ in rm.targets(row)], [True] * 6)  # 96% and 92.5%, every bound met
        late = dict(row, layer_ms=[0.6 * (l + 1) + (0.76 if l == 7 else 0.75) for l in range(32)])
        ok, text = rm.targets(late)[2]
        self.assertFalse(ok)
        self.assertIn("first layer 7", text)
        self.assertFalse(rm.targets(dict(row, floor_over_reload=0.949))[0][0])  # 95% from 8k tokens
        self.assertTrue(rm.targets(dict(row, tokens=2048, floor_over_reload=0.92))[0][0])  # 92% below
        self.assertFalse(rm.targets(dict(row, d2h_over_store=0.919))[1][0])
        self.assertFalse(rm.targets(dict(row, load_return_ms=1.51))[3][0])
        self.assertFalse(rm.targets(dict(row, store_call_ms=1.51))[3][0])
        self.assertFalse(rm.targets(dict(row, wait0_ms=1.01))[4][0])
        self.assertFalse(rm.targets(dict(row, first={"store_ms": 24.1}))[5][0])
        # Not measured: fails.
        self.assertFalse(rm.targets(dict(row, first={}))[5][0])
        self.assertFalse(rm.targets(dict(row, h2d_ms=float("nan")))[2][0])

    def test_svg(self):
        import xml.etree.ElementTree as ET
        rm = self.rm
        rows = [rm.make_row(t, prefill_ms=0.03 * t, reload_ms=t / 400, load_return_ms=0.2, layer_ms=[1.0] * 32,
                            layer_total_ms=t / 400, store_ms=t / 390, h2d_ms=t / 420, d2h_ms=t / 410)
                for t in (8192, 2048, 32768)]
        svg = rm.format_svg(rows)
        root = ET.fromstring(svg)  # well-formed XML
        ns = {"s": "http://www.w3.org/2000/svg"}
        self.assertEqual(root.tag, "{http://www.w3.org/2000/svg}svg")
        lines = {p.get("data-series"): p for p in root.findall("s:polyline", ns)}
        self.assertEqual(set(lines), {"prefill_ms", "reload_ms", "h2d_ms"})
        texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
        for want in ("2048", "8192", "32768", "reload (kvoffload load)", "recompute (prefill)"):
            self.assertIn(want, texts)

        def points(key):
            return [tuple(map(float, p.split(","))) for p in lines[key].get("points").split()]

        reload, recompute = points("reload_ms"), points("prefill_ms")
        self.assertEqual(len(reload), 3)
        # Across by prompt length, left to right; longer times higher up
        # (smaller y); recompute is slower than reload at every length.
        self.assertEqual([x for x, _ in reload], sorted(x for x, _ in reload))
        self.assertTrue(all(yr > yc for (_, yr), (_, yc) in zip(reload, recompute)))
        self.assertTrue(reload[0][1] > reload[-1][1])
        for x, y in reload + recompute:
            self.assertTrue(0 <= x <= float(root.get("width")) and 0 <= y <= float(root.get("height")))
        self.assertEqual(rm.svg_path("/tmp/out/realmodel.md"), "/tmp/out/realmodel.svg")

    def test_svg_edge_cases(self):
        import xml.etree.ElementTree as ET
        rm = self.rm
        ET.fromstring(rm.format_svg([]))
        one = rm.make_row(2048, prefill_ms=61.5, reload_ms=5.0, load_return_ms=0.2, layer_ms=[1.0] * 32,
                          layer_total_ms=5.0, store_ms=5.2, h2d_ms=float("nan"), d2h_ms=4.9)
        root = ET.fromstring(rm.format_svg([one], title="a <title> & more"))
        keys = [p.get("data-series") for p in root.findall("{http://www.w3.org/2000/svg}polyline")]
        self.assertEqual(sorted(keys), ["prefill_ms", "reload_ms"])  # the nan series is left out


if __name__ == "__main__":
    unittest.main()
