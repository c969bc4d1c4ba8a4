"""Layouts from KV tensors, with stand-ins for torch tensors (torch is not
needed: kvoffload.layout reads only the tensor protocol)."""

import unittest

import kvoffload
from kvoffload.layout import layout_from_tensors

from .helpers import block_holds, host_config, keys_for, needs_library, write_block


class Device:
    def __init__(self, type_, index=None):
        self.type, self.index = type_, index

    def __str__(self):
        return self.type if self.index is None else f"{self.type}:{self.index}"


class FakeTensor:
    """What layout_from_tensors reads of a torch tensor."""

    def __init__(self, shape, device=("cuda", 0), dtype="bfloat16", elsize=2, ptr=1 << 32, contiguous=True):
        self.shape, self.dtype, self._elsize, self._ptr, self._contig = tuple(shape), dtype, elsize, ptr, contiguous
        self.device = Device(*device)

    def stride(self):
        s, acc = [], 1
        for d in reversed(self.shape):
            s.append(acc)
            acc *= d
        return tuple(reversed(s))

    def is_contiguous(self):
        return self._contig

    def element_size(self):
        return self._elsize

    def data_ptr(self):
        return self._ptr

    def __getitem__(self, i):
        inner = 1
        for d in self.shape[1:]:
            inner *= d
        return FakeTensor(self.shape[1:], (self.device.type, self.device.index), self.dtype, self._elsize,
                          self._ptr + i * inner * self._elsize, self._contig)


def layer_pairs(layers=4, blocks=10, tpb=16, heads=8, dim=128, **kw):
    per = blocks * tpb * heads * dim * 2
    return [(FakeTensor((blocks, tpb, heads, dim), ptr=(1 << 32) + 2 * l * per, **kw),
             FakeTensor((blocks, tpb, heads, dim), ptr=(1 << 32) + (2 * l + 1) * per, **kw)) for l in range(layers)]


class Layouts(unittest.TestCase):
    def test_layer_separate(self):
        layout, backend, device, keep = layout_from_tensors(layer_pairs())
        self.assertEqual((backend, device), ("cuda", 0))
        self.assertEqual(layout["kind"], "layer-separate")
        self.assertEqual((layout["layers"], layout["kv_heads"], layout["head_dim"], layout["tokens_per_block"],
                          layout["num_blocks"], layout["dtype_bytes"]), (4, 8, 128, 16, 10, 2))
        self.assertEqual(layout["layer_tensors"][0]["stride"], 16 * 8 * 128 * 2)
        self.assertEqual(len(keep), 8)

    def test_vllm_stacked_kv(self):
        stacked = [FakeTensor((2, 10, 16, 8, 128), ptr=(1 << 32) * (l + 1)) for l in range(3)]
        layout, *_ = layout_from_tensors(stacked)
        t = layout["layer_tensors"][0]
        self.assertEqual(t["v"] - t["k"], 10 * 16 * 8 * 128 * 2)

    def test_flattened_needs_geometry(self):
        flat = [(FakeTensor((10, 16 * 8 * 128)), FakeTensor((10, 16 * 8 * 128), ptr=1 << 40))]
        with self.assertRaises(kvoffload.InvalidArgumentError):
            layout_from_tensors(flat)
        layout, *_ = layout_from_tensors(flat, tokens_per_block=16, kv_heads=8, head_dim=128)
        self.assertEqual(layout["head_dim"], 128)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            layout_from_tensors(flat, tokens_per_block=16, kv_heads=8, head_dim=64)

    def test_cross_layer(self):
        t = FakeTensor((10, 32, 2, 16, 8, 128))
        layout, *_ = layout_from_tensors(t)
        self.assertEqual((layout["kind"], layout["layers"], layout["stride"]), ("cross-layer", 32, 32 * 2 * 16 * 8 * 128 * 2))
        flat = FakeTensor((10, 32 * 2 * 16 * 8 * 128))
        with self.assertRaises(kvoffload.InvalidArgumentError):
            layout_from_tensors(flat)
        layout2, *_ = layout_from_tensors(flat, layers=32, tokens_per_block=16, kv_heads=8, head_dim=128)
        self.assertEqual(layout2["stride"], layout["stride"])

    def test_mla(self):
        layout, *_ = layout_from_tensors([FakeTensor((10, 64, 576), ptr=(1 << 32) * (l + 1)) for l in range(2)])
        self.assertEqual((layout["kind"], layout["kv_heads"], layout["head_dim"], layout["tokens_per_block"]),
                         ("mla", 1, 576, 64))

    def test_cpu_is_host(self):
        _, backend, _, _ = layout_from_tensors(layer_pairs(device=("cpu", None)))
        self.assertEqual(backend, "host")

    def test_bad(self):
        pairs = layer_pairs()
        mixed_dev = layer_pairs()
        mixed_dev[2] = (FakeTensor((10, 16, 8, 128), device=("cuda", 1)), mixed_dev[2][1])
        mixed_dtype = layer_pairs()
        mixed_dtype[1] = (FakeTensor((10, 16, 8, 128), dtype="float16"), mixed_dtype[1][1])
        mixed_shape = layer_pairs()
        mixed_shape[3] = (mixed_shape[3][0], FakeTensor((11, 16, 8, 128)))
        cases = {
            "wrong device": (layer_pairs(device=("meta", None)), "meta"),
            "two devices": (mixed_dev, "one device"),
            "non-contiguous": (layer_pairs(contiguous=False), "not contiguous"),
            "3-d tensor": ([(FakeTensor((10, 16, 8)), FakeTensor((10, 16, 8)))], "shape"),
            "1-d tensor": ([(FakeTensor((10,)), FakeTensor((10,)))], "shape"),
            "mixed dtypes": (mixed_dtype, "dtype"),
            "mixed shapes": (mixed_shape, "shape"),
            "not a tensor": ([(1, 2)], "not a tensor"),
            "three tensors": ([(pairs[0][0], pairs[0][1], pairs[0][1])], "(K, V) pair"),
            "empty": ([], "empty"),
            "cross-layer bad dim": (FakeTensor((10, 32, 3, 16, 8, 128)), "K and V"),
            "stacked without 2": ([FakeTensor((3, 10, 16, 8, 128))], "[2, num_blocks"),
        }
        for name, (arg, text) in cases.items():
            with self.subTest(name), self.assertRaises(kvoffload.InvalidArgumentError) as cm:
                layout_from_tensors(arg)
            self.assertIn(text, str(cm.exception), name)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            layout_from_tensors(pairs, tokens_per_block=32)


class TensorParallelLayouts(unittest.TestCase):
    """The rank's head range and the GPU order (model_kv_heads, head_first,
    order)."""

    def test_rank_of_tp2(self):
        # Rank 1 of TP=2 of an 8-head model: its tensors hold 4 heads.
        layout, *_ = layout_from_tensors(layer_pairs(heads=4), model_kv_heads=8, head_first=4)
        self.assertEqual((layout["kv_heads"], layout["model_kv_heads"], layout["head_first"], layout["order"]),
                         (4, 8, 4, "token-major"))
        self.assertEqual(layout["layer_tensors"][0]["stride"], 16 * 4 * 128 * 2)

    def test_undeclared_unchanged(self):
        layout, *_ = layout_from_tensors(layer_pairs())
        for field in ("model_kv_heads", "head_first", "order"):
            self.assertNotIn(field, layout)
        layout, *_ = layout_from_tensors(layer_pairs(), order="token-major")
        self.assertEqual(layout["order"], "token-major")
        self.assertNotIn("model_kv_heads", layout)

    def test_head_major_shape(self):
        # [num_blocks, kv_heads, tokens_per_block, head_dim] when head-major.
        pairs = [(FakeTensor((10, 2, 16, 128)), FakeTensor((10, 2, 16, 128), ptr=1 << 40))]
        layout, *_ = layout_from_tensors(pairs, model_kv_heads=8, head_first=6, order="head-major")
        self.assertEqual((layout["kv_heads"], layout["tokens_per_block"], layout["order"]), (2, 16, "head-major"))

    def test_flattened_needs_order(self):
        flat = [(FakeTensor((10, 16 * 4 * 128)), FakeTensor((10, 16 * 4 * 128), ptr=1 << 40))]
        geo = dict(tokens_per_block=16, kv_heads=4, head_dim=128)
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            layout_from_tensors(flat, model_kv_heads=8, **geo)
        self.assertIn("order", str(cm.exception))
        layout, *_ = layout_from_tensors(flat, model_kv_heads=8, head_first=0, order="head-major", **geo)
        self.assertEqual(layout["order"], "head-major")

    def test_bad(self):
        cases = {
            "range past the model": (dict(model_kv_heads=8, head_first=6), "[6, 10)"),
            "more heads than the model": (dict(model_kv_heads=2), "model_kv_heads = 2"),
            "negative first": (dict(model_kv_heads=8, head_first=-1), "head_first = -1"),
            "first without the model": (dict(head_first=4), "without model_kv_heads"),
            "zero model heads": (dict(model_kv_heads=0), "model_kv_heads = 0"),
            "bool model heads": (dict(model_kv_heads=True), "model_kv_heads = True"),
            "unknown order": (dict(order="sideways"), "sideways"),
        }
        for name, (kw, text) in cases.items():
            with self.subTest(name), self.assertRaises(kvoffload.InvalidArgumentError) as cm:
                layout_from_tensors(layer_pairs(heads=4), **kw)
            self.assertIn(text, str(cm.exception), name)
        with self.assertRaises(kvoffload.InvalidArgumentError):
            layout_from_tensors([FakeTensor((10, 64, 576))], model_kv_heads=2)


@needs_library
class TensorParallelHostEngine(unittest.TestCase):
    """The layout fields through the C ABI, on the host backend."""

    def rank_config(self, first, heads=1):
        cfg = host_config()
        cfg["layout"] = dict(cfg["layout"], kv_heads=heads, model_kv_heads=2, head_first=first, order="token-major")
        return cfg

    def test_rank_store_is_partial(self):
        with kvoffload.Engine(self.rank_config(1)) as eng:
            layout = eng.config["layout"]
            self.assertEqual((layout["kv_heads"], layout["model_kv_heads"], layout["head_first"], layout["order"]),
                             (1, 2, 1, "token-major"))
            keys = keys_for(3, 5)
            with eng.store(keys, [0, 1, 2]) as op:
                self.assertEqual(op.wait(), ["stored"] * 3)
            # One rank of two stored: the blocks wait for the other's heads.
            self.assertEqual(eng.lookup(keys), 0)
            st = eng.stats()
            self.assertEqual((st["partial"], st["partial_expired"], st["store_joined"]), (3, 0, 0))
            with eng.load(keys, [3, 4, 5]) as op:
                self.assertEqual(op.wait(), ["missing"] * 3)

    def test_all_heads_round_trip(self):
        cfg = self.rank_config(0, heads=2)
        with kvoffload.Engine(cfg) as eng:
            keys = keys_for(2, 6)
            for b in range(2):
                write_block(eng, b, 3)
            with eng.store(keys, [0, 1]) as op:
                self.assertEqual(op.wait(), ["stored"] * 2)
            self.assertEqual(eng.lookup(keys), 2)
            with eng.load(keys, [10, 11], per_layer=True) as op:
                self.assertEqual(op.wait(), ["loaded"] * 2)
            for b in range(2):
                self.assertTrue(block_holds(eng, 10 + b, b, 3))

    def test_bad_range_refused(self):
        cfg = self.rank_config(2)
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            kvoffload.Engine(cfg)
        self.assertIn("[2, 3)", str(cm.exception))


@needs_library
class EngineFromTensors(unittest.TestCase):
    def test_cuda_tensors_not_device_memory(self):
        # Validation of shapes passes; the addresses are not device memory:
        # without a GPU the CUDA backend is refused (no driver), with one the
        # engine refuses addresses outside any device allocation.
        with self.assertRaises(kvoffload.KvoError) as cm:
            kvoffload.Engine.from_tensors(layer_pairs(layers=2), pool_bytes=1 << 20, skip_memory_check=True)
        self.assertTrue(str(cm.exception))

    def test_cpu_tensors_refused(self):
        with self.assertRaises(kvoffload.InvalidArgumentError) as cm:
            kvoffload.Engine.from_tensors(layer_pairs(device=("cpu", None)), pool_bytes=1 << 20)
        self.assertIn("config dict", str(cm.exception))

    def test_bad_tensors_raise_before_loading(self):
        with self.assertRaises(kvoffload.InvalidArgumentError):
            kvoffload.Engine.from_tensors(layer_pairs(contiguous=False), pool_bytes=1 << 20)


if __name__ == "__main__":
    unittest.main()
