"""The after= events an engine records are reused only once the op that
used them is done, and an op is released without waiting (release() and
the finalizer). Runs without torch: a fake stream and event factory stand
in for torch.cuda (their CUevent is 0, so the host backend waits on
nothing; what is checked is which event each op gets, and when)."""

import gc
import time
import unittest

import kvoffload
from kvoffload import engine as engine_mod

from .helpers import host_config, keys_for, needs_library

DELAY_NS = 300_000_000  # every simulated copy takes 0.3 s


class FakeStream:
    cuda_stream = 0


class FakeEvent:
    made = 0

    def __init__(self):
        FakeEvent.made += 1
        self.id = FakeEvent.made
        self.records = 0
        self.cuda_event = 0

    def record(self, stream):
        assert isinstance(stream, FakeStream)
        self.records += 1


class EventPoolUnit(unittest.TestCase):
    def test_get_put(self):
        pool = engine_mod._EventPool(FakeEvent, keep=2)
        a, b, c = pool.get(), pool.get(), pool.get()
        self.assertEqual(pool.created, 3)
        self.assertEqual(len({a.id, b.id, c.id}), 3)
        for ev in (a, b, c):
            pool.put(ev)
        self.assertEqual(pool.idle(), 2, "at most keep idle events")
        self.assertIn(pool.get(), (a, b))
        self.assertEqual(pool.created, 3)

    def test_record_failure_gives_event_back(self):
        class Broken(FakeEvent):
            def record(self, stream):
                raise RuntimeError("record failed")

        pool = engine_mod._EventPool(Broken)
        with self.assertRaises(RuntimeError):
            engine_mod._record_on(FakeStream(), pool)
        self.assertEqual(pool.idle(), 1)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            engine_mod._record_on(object(), pool)


@needs_library
class EngineEvents(unittest.TestCase):
    def engine(self, slow):
        sim = {"seed": 1, "min_delay_ns": DELAY_NS, "max_delay_ns": DELAY_NS} if slow else None
        eng = kvoffload.Engine(host_config(sim=sim) if slow else host_config())
        self.addCleanup(eng.close)
        eng._events = engine_mod._EventPool(FakeEvent)
        return eng

    def test_reused_after_done(self):
        eng, s = self.engine(False), FakeStream()
        seen = []
        for i in range(5):
            with eng.store(keys_for(1, 100 + i), [i], after=s) as op:
                seen.append(op._pooled[0])
                self.assertEqual(op.wait(), ["stored"])
            with eng.load(keys_for(1, 100 + i), [10 + i], after=s) as op:
                seen.append(op._pooled[0])
                op.wait()
        self.assertEqual(eng._events.created, 1, "one event serves ops that are done one after another")
        self.assertEqual(seen[0].records, 10)

    def test_not_reused_while_in_flight(self):
        eng, s = self.engine(True), FakeStream()
        op1 = eng.store(keys_for(1, 200), [0], after=s)
        op2 = eng.store(keys_for(1, 201), [1], after=s)
        self.assertFalse(op1.done())
        ev1, ev2 = op1._pooled[0], op2._pooled[0]
        self.assertIsNot(ev1, ev2, "an event an op in flight may still wait on is not recorded again")
        self.assertEqual((ev1.records, ev2.records), (1, 1))
        op1.wait()
        op3 = eng.store(keys_for(1, 202), [2], after=s)
        self.assertIs(op3._pooled[0], ev1, "op1 is done: its event is reused")
        self.assertEqual(ev1.records, 2)
        for op in (op2, op3):
            op.wait()
            op.release()
        op1.release()
        self.assertEqual(eng._events.created, 2)

    def test_failed_call_gives_event_back(self):
        eng, s = self.engine(False), FakeStream()
        with self.assertRaises(kvoffload.InvalidArgumentError):
            eng.store(keys_for(1, 300), [10_000], after=s)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            eng.load(keys_for(1, 300), [-1], after=s)  # the same event, given back again
        self.assertEqual((eng._events.created, eng._events.idle()), (1, 1))

    def test_release_in_flight_does_not_wait(self):
        eng, s = self.engine(True), FakeStream()
        op = eng.store(keys_for(1, 400), [0], after=s)
        ev = op._pooled[0]
        t0 = time.monotonic()
        op.release()
        self.assertLess(time.monotonic() - t0, DELAY_NS / 1e9 / 2, "release waited for the op")
        with self.assertRaises(kvoffload.ReleasedError):
            op.wait()
        self.assertEqual(len(eng._retiring), 1, "handed to the engine")
        # While it is in flight its event is not handed out again.
        op2 = eng.store(keys_for(1, 401), [1], after=s)
        self.assertIsNot(op2._pooled[0], ev)
        op2.wait()
        op2.release()
        # Once done, the engine's next call releases it and reuses the event.
        deadline = time.monotonic() + 30
        while eng._retiring and time.monotonic() < deadline:
            time.sleep(0.05)
            eng._reap()
        self.assertEqual(len(eng._retiring), 0)
        self.assertIn(ev, eng._events._free)

    def test_finalizer_does_not_wait(self):
        eng, s = self.engine(True), FakeStream()
        op = eng.store(keys_for(1, 500), [0], after=s)
        t0 = time.monotonic()
        del op
        gc.collect()
        self.assertLess(time.monotonic() - t0, DELAY_NS / 1e9 / 2, "the finalizer waited for the op")
        self.assertEqual(len(eng._retiring), 1)
        # A load's op too, without after=.
        op = eng.load(keys_for(1, 501), [1])
        del op
        gc.collect()
        eng.close()  # waits for the copies, then releases the handed-over ops
        self.assertEqual(len(eng._retiring), 0)

    def test_release_done_op_at_once(self):
        eng, s = self.engine(False), FakeStream()
        op = eng.store(keys_for(1, 600), [0], after=s)
        ev = op._pooled[0]
        while not op.done():
            time.sleep(0.01)
        op.release()
        self.assertEqual(len(eng._retiring), 0)
        self.assertIn(ev, eng._events._free)


if __name__ == "__main__":
    unittest.main()
