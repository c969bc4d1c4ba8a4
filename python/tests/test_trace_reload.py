"""bench/trace_reload.py's trace reading, on a synthetic trace (no torch, no
GPU), so that CI runs it."""

import unittest

from .helpers import load_script



def load():
    return load_script('bench/trace_reload.py')


class TraceWindows(unittest.TestCase):
    def test_head_does_not_split_an_op(self):
        # Two loads. The first's head copy runs under the call's GPU-side
        # annotation, its other copies after it; one window per op from
        # the CPU-side annotation, each op's copies in its own window.
        tr = load()
        ev = [
            {"ph": "X", "cat": "user_annotation", "name": "load-128", "ts": 1000, "dur": 300},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "load-128", "ts": 1100, "dur": 80},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1100, "dur": 80, "tid": 13},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "load-128", "ts": 1400, "dur": 5000},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 1400, "dur": 4000, "tid": 13},
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 1050, "dur": 10},
            {"ph": "X", "cat": "user_annotation", "name": "load-per-layer-128", "ts": 9000, "dur": 300},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 9200, "dur": 4000, "tid": 13},
        ]
        out = tr.windows(ev)
        heads = [ln for ln in out if ln.startswith("### ")]
        self.assertEqual(len(heads), 2, out)
        self.assertTrue(heads[0].startswith("### load-128 "))
        self.assertTrue(heads[1].startswith("### load-per-layer-128 "))
        first = out[out.index(heads[0]) + 1]
        self.assertIn("first at +0.100 ms", first)
        self.assertIn("busy 4.080 ms", first)  # the head's copy and the rest, one op
        self.assertIn("2×", out[out.index(heads[0]) + 2])


if __name__ == "__main__":
    unittest.main()
