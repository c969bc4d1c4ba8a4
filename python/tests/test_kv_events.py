"""KV events (engine.events()) and metrics (engine.metrics_text()) on the
host backend: the events of stores, evictions and deletes, in order and
after the fact, agree with stats(); the metrics text carries the same
counters."""

import unittest

import kvoffload

from .helpers import TPB, keys_for, needs_library, small_config


@needs_library
class KVEvents(unittest.TestCase):
    def setUp(self):
        self.eng = kvoffload.Engine(small_config(4))

    def tearDown(self):
        self.eng.close()

    def store(self, keys, tokens=None, parent=None):
        op = self.eng.store(keys, list(range(len(keys))), tokens=tokens, parent=parent)
        op.wait()
        op.release()

    def test_events_follow_the_ops(self):
        it = self.eng.events()
        a = keys_for(3, 1)
        tokens = list(range(3 * TPB))
        self.store(a, tokens=tokens)
        b = keys_for(3, 2)  # the pool holds 4 blocks: storing b evicts
        self.store(b)
        self.assertEqual(self.eng.delete([b[0]]), 1)
        evs = list(it)
        st = self.eng.stats()
        stored = [e for e in evs if e["type"] == "BlockStored"]
        removed = [e for e in evs if e["type"] == "BlockRemoved"]
        self.assertEqual(len(stored), st["outcomes"][1])  # outcome "stored"
        self.assertEqual(len(removed), st["evictions"] + st["deletes"])
        self.assertGreater(st["evictions"], 0)
        first = stored[0]
        self.assertEqual(first["block_hashes"], [a[0]])
        self.assertIsNone(first["parent_block_hash"])
        self.assertEqual(first["token_ids"], tokens[:TPB])
        self.assertEqual(first["block_size"], TPB)
        self.assertEqual(first["medium"], "CPU")
        self.assertEqual(stored[1]["parent_block_hash"], a[0])
        self.assertEqual(stored[3]["token_ids"], [])  # b was stored without tokens
        # Replaying the events gives what lookups see.
        present = set()
        for e in evs:
            (k,) = e["block_hashes"]
            if e["type"] == "BlockStored":
                self.assertNotIn(k, present)
                present.add(k)
            else:
                self.assertIn(k, present, "removed before stored")
                present.discard(k)
        for k in a + b:
            self.assertEqual(self.eng.lookup([k]), 1 if k in present else 0)

    def test_bad_tokens_and_one_stream(self):
        with self.assertRaises(kvoffload.InvalidArgumentError):
            self.eng.store(keys_for(1, 3), [0], tokens=[1, 2])
        it = self.eng.events(buffer=2)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            self.eng.events()
        self.store(keys_for(4, 4))
        self.assertEqual(self.eng.events_dropped(), 2)  # 4 stored, room for 2
        self.assertEqual(len(list(it)), 2)
        again = self.eng.events()  # the first iterator ended: its stream is closed
        self.assertEqual(list(again), [])

    def test_metrics_text(self):
        self.store(keys_for(2, 5))
        self.eng.lookup(keys_for(2, 5))
        text = self.eng.metrics_text()
        st = self.eng.stats()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        self.assertEqual(samples['kvoffload_cpu_block_hit_total{tier="cpu"}'], st["hits"])
        self.assertEqual(samples['kvoffload_total_bytes_total{transfer_type="GPU_to_CPU"}'], st["copies"]["store"]["bytes"])
        self.assertIn("# TYPE kvoffload_transfer_latency_seconds histogram", text)


if __name__ == "__main__":
    unittest.main()
