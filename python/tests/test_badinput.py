"""Bad values get the right error class and a message naming the value and
the limit, before ctypes converts them (issue 19): ctypes truncates an
integer out of its C type's range silently and a NUL byte ends a C string,
so neither may reach the library."""

import array
import unittest

import kvoffload
from kvoffload import _lib
from kvoffload.layout import layout_from_tensors

from .helpers import block_holds, host_config, keys_for, needs_library, write_block
from .test_layout import FakeTensor

U64 = 2**64


class CheckInt(unittest.TestCase):
    def test_range_type_and_message(self):
        self.assertEqual(_lib.check_int("n", 5, 0, 10), 5)
        self.assertEqual(_lib.check_int("n", _Index(7), 0, 10), 7)  # __index__ (numpy integers)
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            _lib.check_int("trim: nbytes", U64, 0, _lib.INT64_MAX)
        self.assertIsInstance(cm.exception, ValueError)
        self.assertIn("trim: nbytes", str(cm.exception))
        self.assertIn(str(U64), str(cm.exception))
        self.assertIn(str(_lib.INT64_MAX), str(cm.exception))
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            _lib.check_int("n", -1, 0, 10)
        self.assertIn("-1", str(cm.exception))
        for bad in (True, False, None, 1.0, "3", b"3"):
            with self.subTest(bad=bad), self.assertRaises(TypeError) as cm:
                _lib.check_int("layer", bad, 0, 10)
            self.assertIsInstance(cm.exception, kvoffload.InvalidArgumentError)  # one class for bad input
            self.assertIn("layer", str(cm.exception))

    def test_c_type_ranges(self):
        self.assertEqual((_lib.INT_MIN, _lib.INT_MAX), (-2**31, 2**31 - 1))
        self.assertEqual(_lib.UINT64_MAX, U64 - 1)
        self.assertEqual(_lib.SIZE_MAX, U64 - 1)

    def test_c_string(self):
        self.assertEqual(_lib.c_string("name", "ids"), b"ids")
        self.assertEqual(_lib.c_string("name", "é"), "é".encode())
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            _lib.c_string("staging: name", "n\0x")
        self.assertIsInstance(cm.exception, ValueError)
        self.assertIn("staging: name", str(cm.exception))
        self.assertIn("NUL", str(cm.exception))
        with self.assertRaises(TypeError):
            _lib.c_string("namespace", 5)

    def test_timeout_ns(self):
        self.assertEqual(_lib.timeout_ns("t", None), -1)
        self.assertEqual(_lib.timeout_ns("t", -3), 0)
        self.assertEqual(_lib.timeout_ns("t", 1.5), 1_500_000_000)
        self.assertEqual(_lib.timeout_ns("t", float("inf")), _lib.INT64_MAX)
        self.assertEqual(_lib.timeout_ns("t", 10**400), _lib.INT64_MAX)
        self.assertEqual(_lib.timeout_ns("t", 1e12), _lib.INT64_MAX)  # 1e21 ns: above int64, clamped
        with self.assertRaises(kvoffload.InvalidArgumentError):
            _lib.timeout_ns("t", float("nan"))
        for bad in (True, "1", object()):
            with self.subTest(bad=bad), self.assertRaises(TypeError):
                _lib.timeout_ns("t", bad)


class _Index:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


class MLALayout(unittest.TestCase):
    """The layout helper does not drop a kv_heads or head_dim that
    contradicts an MLA cache (it used to build kv_heads 1 whatever was
    given)."""

    def test_mla_refuses_kv_heads(self):
        mla = [FakeTensor((10, 64, 576), ptr=(1 << 32) * (l + 1)) for l in range(2)]
        layout, *_ = layout_from_tensors(mla, kv_heads=1, head_dim=576)
        self.assertEqual(layout["kv_heads"], 1)
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            layout_from_tensors(mla, kv_heads=2)
        self.assertIn("kv_heads = 2", str(cm.exception))
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            layout_from_tensors(mla, head_dim=512)
        self.assertIn("512", str(cm.exception))
        flat = [FakeTensor((10, 64 * 576), ptr=(1 << 32) * (l + 1)) for l in range(2)]
        with self.assertRaises(kvoffload.InvalidArgumentError):
            layout_from_tensors(flat, kind="mla", tokens_per_block=64, kv_heads=2, head_dim=576)


@needs_library
class BadValues(unittest.TestCase):
    def setUp(self):
        self.eng = kvoffload.Engine(host_config())
        self.addCleanup(self.eng.close)
        self.addr = self.eng.config["layout"]["layer_tensors"][0]["k"]

    def assert_refused(self, f, cls, *texts):
        with self.assertRaises(cls) as cm:
            f()
        self.assertIsInstance(cm.exception, kvoffload.InvalidArgumentError)
        for t in texts:
            self.assertIn(t, str(cm.exception))
        return cm.exception

    def test_numa_node_is_invalid_argument(self):
        e = self.assert_refused(lambda: kvoffload.Engine(host_config(numa_node="99")), kvoffload.InvalidArgumentError,
                                '"99"')
        self.assertEqual(e.code, kvoffload.errors.KVO_EINVAL)
        self.assertNotIsInstance(e, kvoffload.TransferFailedError)

    def test_mla_kv_heads_from_config(self):
        cfg = host_config()
        cfg["layout"] = dict(cfg["layout"], kind="mla", kv_heads=2)
        self.assert_refused(lambda: kvoffload.Engine(cfg), kvoffload.InvalidArgumentError, "2")

    def test_sim_read_negative_and_oversized(self):
        eng, addr = self.eng, self.addr
        for n in (-1, -(2**63), 2**63, U64 - 1):
            with self.subTest(n=n):
                e = self.assert_refused(lambda: eng.sim_read(addr, n), ValueError, "nbytes", str(n))
                self.assertNotIn("panic", str(e))
        self.assert_refused(lambda: eng.sim_read(-1, 4), ValueError, "device_addr", "-1")
        self.assert_refused(lambda: eng.sim_read(U64, 4), ValueError, "device_addr", str(U64))
        self.assert_refused(lambda: eng.sim_write(U64 + 5, b"abc"), ValueError, "device_addr")
        self.assert_refused(lambda: eng.sim_write(addr, 3), TypeError, "data")
        self.assertEqual(eng.sim_read(addr, 0), b"")

    def test_truncated_integers(self):
        eng = self.eng
        limit = str(_lib.INT64_MAX)
        self.assert_refused(lambda: eng.trim(U64), ValueError, "nbytes", str(U64), limit)
        self.assert_refused(lambda: eng.trim(U64 + 1024), ValueError, str(U64 + 1024))
        self.assert_refused(lambda: eng.trim(-1), ValueError, "-1")
        self.assert_refused(lambda: eng.staging("c", U64), ValueError, "nbytes", str(U64), limit)
        self.assert_refused(lambda: eng.staging("c", 2**63), ValueError, str(2**63))
        keys = keys_for(2, 7)
        with eng.store(keys, [0, 1]) as st:
            st.wait()
        with eng.load(keys, [2, 3], per_layer=True) as op:
            op.wait()
            self.assertEqual(op.layer_event(1), 0)
            self.assert_refused(lambda: op.layer_event(2**40), ValueError, "layer", str(2**40), str(2**31 - 1))
            self.assert_refused(lambda: op.layer_event(2**32), ValueError, str(2**32))
            self.assert_refused(lambda: op.wait_stream(U64), ValueError, "stream", str(U64))
            self.assert_refused(lambda: op.wait_stream(-1), ValueError, "stream")
        self.assert_refused(lambda: eng.load(keys, [4, 5], signal=-1), ValueError, "signal")
        self.assert_refused(lambda: eng.load(keys, [4, 5], signal=U64), ValueError, "signal", str(U64))
        self.assert_refused(lambda: eng.store(keys, [0, 2**63]), ValueError, "block id 1", str(2**63))
        self.assert_refused(lambda: eng.store(keys, [0, U64]), ValueError, "block id 1")

    def test_packed_inputs(self):
        # keys as one bytes object and block ids as array('q') skip the
        # per-item checks; the bytes still round-trip, and a wrong count or
        # an id outside the layout is still refused.
        eng = self.eng
        keys = keys_for(3, 9)
        for i, b in enumerate((0, 1, 2)):
            write_block(eng, b, 40 + i)
        with eng.store(b"".join(keys), array.array("q", [0, 1, 2])) as op:
            self.assertEqual(op.wait(), ["stored"] * 3)
        with eng.load(b"".join(keys), array.array("q", [5, 6, 7])) as op:
            self.assertEqual(op.wait(), ["loaded"] * 3)
        for i, b in enumerate((5, 6, 7)):
            self.assertTrue(block_holds(eng, b, i, 40 + i), f"block {b}")
        self.assert_refused(lambda: eng.load(keys, array.array("q", [5, 6])), ValueError, "3 keys but 2 block ids")
        self.assert_refused(lambda: eng.load(keys, array.array("q", [5, 6, 10**9])), ValueError, str(10**9))

    def test_bool_and_non_int(self):
        eng = self.eng
        keys = keys_for(1, 8)
        self.assert_refused(lambda: eng.store(keys, [True]), TypeError, "block id 0", "bool")
        self.assert_refused(lambda: eng.load(keys, [False]), TypeError, "block id 0")
        self.assert_refused(lambda: eng.store(keys, [0.0]), TypeError, "block id 0", "float")
        self.assert_refused(lambda: eng.store(keys, None), TypeError, "block_ids")
        self.assert_refused(lambda: eng.store(keys, 3), TypeError, "block_ids")
        self.assertEqual(eng.lookup(keys), 0, "nothing stored by a refused call")
        self.assert_refused(lambda: eng.lookup(None), TypeError, "keys", "NoneType")
        self.assert_refused(lambda: eng.lookup(5), TypeError, "keys", "int")
        self.assert_refused(lambda: eng.lookup("k" * 16), TypeError, "keys")
        self.assert_refused(lambda: eng.delete(None), TypeError, "keys")
        self.assert_refused(lambda: eng.trim(True), TypeError, "nbytes", "bool")
        self.assert_refused(lambda: eng.trim(1.5), TypeError, "nbytes", "float")
        self.assert_refused(lambda: eng.trim("5"), TypeError, "nbytes")
        self.assert_refused(lambda: eng.trim(0, timeout="1"), TypeError, "timeout")
        self.assert_refused(lambda: eng.staging("x", True), TypeError, "nbytes")
        self.assert_refused(lambda: eng.staging(None, 64), TypeError, "name", "NoneType")
        self.assert_refused(lambda: eng.sim_read(self.addr, True), TypeError, "nbytes")
        self.assert_refused(lambda: eng.sim_read(self.addr, None), TypeError, "nbytes")
        self.assert_refused(lambda: eng.clear(5), TypeError, "namespace")
        self.assert_refused(lambda: eng.wait_grown("1"), TypeError, "timeout")
        self.assert_refused(lambda: kvoffload.Engine(host_config(policy=object())), TypeError, "config")
        self.assert_refused(lambda: kvoffload.chain_keys([1, True, 3, 4], 4), TypeError, "True")
        self.assert_refused(lambda: kvoffload.chain_keys([1, 2, 3, 2**32], 4), ValueError, str(2**32))
        with eng.store(keys, [0]) as op:
            op.wait()
            self.assert_refused(lambda: op.layer_event(True), TypeError, "layer", "bool")
            self.assert_refused(lambda: op.layer_event(None), TypeError, "layer")
            self.assert_refused(lambda: op.wait(timeout=float("nan")), ValueError, "NaN")
            self.assertEqual(op.wait(timeout=float("inf")), ["stored"])
        self.assertTrue(eng.wait_grown(float("inf")))

    def test_nul_in_names(self):
        eng = self.eng
        self.assert_refused(lambda: eng.staging("n\0x", 64), ValueError, "name", "NUL")
        s = eng.staging("n", 64)
        self.assertEqual(s.nbytes, 64)
        self.assertEqual(eng.store(keys_for(2, 9), [0, 1]).wait(), ["stored", "stored"])
        self.assert_refused(lambda: eng.clear("py-test\0garbage"), ValueError, "namespace", "NUL")
        self.assertEqual(eng.lookup(keys_for(2, 9)), 2, "the refused clear cleared nothing")
        self.assert_refused(lambda: eng.clear(b"py-test\0"), ValueError, "namespace")
        self.assertEqual(eng.clear(b"py-test"), 2)
        self.assert_refused(lambda: kvoffload.Engine(host_config(namespace="ns\0garbage")),
                            kvoffload.InvalidArgumentError, "NUL")

    def test_layer_event_host_backend(self):
        eng = self.eng
        keys = keys_for(2, 10)
        with eng.store(keys, [0, 1]) as st:
            st.wait()
            self.assert_refused(lambda: st.layer_event(0), kvoffload.InvalidArgumentError, "no per-layer events")
        with eng.load(keys, [2, 3]) as op:
            op.wait()
            self.assert_refused(lambda: op.layer_event(0), kvoffload.InvalidArgumentError, "no per-layer events")
        with eng.load(keys, [2, 3], per_layer=True) as op:
            op.wait()
            self.assertEqual([op.layer_event(0), op.layer_event(1)], [0, 0])
            self.assert_refused(lambda: op.layer_event(2), kvoffload.InvalidArgumentError, "layer 2")
            self.assert_refused(lambda: op.layer_event(99), kvoffload.InvalidArgumentError, "layer 99")
            self.assert_refused(lambda: op.layer_event(-1), kvoffload.InvalidArgumentError, "layer -1")
            op.wait_layer(1, None)  # host backend: nothing to wait on


if __name__ == "__main__":
    unittest.main()
