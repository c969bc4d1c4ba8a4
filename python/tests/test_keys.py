import ctypes
import json
import os
import random
import unittest

import kvoffload
from kvoffload import _lib

from .helpers import needs_library

VECTORS = os.path.join(os.path.dirname(__file__), "..", "..", "kvcache", "testdata", "key_vectors.json")


class KeyVectors(unittest.TestCase):
    """The pure-Python keys equal the committed vectors (which Go's tests
    check too)."""

    def test_vectors(self):
        with open(VECTORS) as f:
            cases = json.load(f)["cases"]
        self.assertGreater(len(cases), 2)
        for c in cases:
            with self.subTest(c["name"]):
                keys = kvoffload.chain_keys(c["tokens"], c["tokens_per_block"],
                                            namespace=bytes.fromhex(c["namespace_hex"]),
                                            parent=bytes.fromhex(c["parent_hex"]))
                self.assertEqual([k.hex() for k in keys], c["keys_hex"])

    def test_block_key_chains(self):
        toks = list(range(48))
        keys = kvoffload.chain_keys(toks, 16, namespace="m")
        self.assertEqual(len(keys), 3)
        self.assertEqual(keys[0], kvoffload.block_key(toks[:16], namespace=b"m"))
        self.assertEqual(keys[2], kvoffload.block_key(toks[32:], namespace="m", parent=keys[1]))
        self.assertEqual(kvoffload.chain_keys(toks[16:], 16, namespace="m", parent=keys[0]), keys[1:])

    def test_bad_input(self):
        bad = [
            lambda: kvoffload.chain_keys([1, 2], 0),
            lambda: kvoffload.chain_keys([1, 2], True),
            lambda: kvoffload.chain_keys([1, -2], 2),
            lambda: kvoffload.chain_keys([1, 1 << 32], 2),
            lambda: kvoffload.chain_keys([1, 2], 2, parent=b"short"),
            lambda: kvoffload.chain_keys([1, 2], 2, namespace=3),
        ]
        for f in bad:
            with self.assertRaises(kvoffload.InvalidArgumentError):
                f()

    def test_pack_keys(self):
        # The list-of-bytes fast path and the checked loop agree, and a bad
        # key in a list of bytes is still named by its index.
        from kvoffload.keys import pack_keys
        keys = [os.urandom(16) for _ in range(300)]
        self.assertEqual(pack_keys(keys), (b"".join(keys), 300))
        self.assertEqual(pack_keys(iter(keys)), (b"".join(keys), 300))
        mixed = keys[:2] + [bytearray(keys[2]), memoryview(keys[3])]
        self.assertEqual(pack_keys(mixed), (b"".join(keys[:4]), 4))
        for bad, want, name in [
            (keys[:5] + [keys[5][:15], keys[6] + b"x"], kvoffload.InvalidArgumentError, "key 5 is 15 bytes"),
            (keys[:3] + ["a" * 16], kvoffload.ArgumentTypeError, "key 3 is a str"),
            (keys[:3] + [memoryview(b"\0" * 16).cast("H")], None, None),
        ]:
            if want is None:
                self.assertEqual(pack_keys(bad)[1], 4)  # 16 bytes as 8 shorts: the loop takes its bytes
                continue
            with self.assertRaisesRegex(want, name):
                pack_keys(bad)

    def test_import_loads_nothing(self):
        # In a fresh interpreter: other tests of this run may import torch.
        import os
        import subprocess
        import sys
        pkg = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        code = "import sys, kvoffload; from kvoffload import _lib; kvoffload.chain_keys([1, 2], 2); print('torch' in sys.modules, _lib.loaded())"
        out = subprocess.run([sys.executable, "-c", code], cwd=pkg, capture_output=True, text=True, check=True).stdout.split()
        self.assertEqual(out, ["False", "False"], "importing kvoffload and making keys imported torch or loaded the library")


@needs_library
class KeysMatchLibrary(unittest.TestCase):
    """Random inputs: Python's keys equal the library's kvo_chain_keys."""

    def test_random(self):
        lib = _lib.get()
        rng = random.Random(7)
        for _ in range(50):
            tpb = rng.choice([1, 3, 16, 64])
            toks = [rng.randrange(1 << 32) for _ in range(rng.randrange(0, 300))]
            ns = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 20)))
            parent = bytes(rng.randrange(256) for _ in range(16)) if rng.random() < 0.5 else None
            want = kvoffload.chain_keys(toks, tpb, namespace=ns, parent=parent)
            arr = (ctypes.c_uint32 * max(len(toks), 1))(*toks)
            out = ctypes.create_string_buffer(16 * max(len(want), 1))
            n = ctypes.c_size_t(0)
            rc = lib.kvo_chain_keys(ns or None, len(ns), parent, arr, len(toks), tpb, out, len(want), ctypes.byref(n))
            self.assertEqual(rc, 0, _lib.last_error(lib))
            self.assertEqual(n.value, len(want))
            got = [out.raw[16 * i:16 * i + 16] for i in range(n.value)]
            self.assertEqual(got, want)


if __name__ == "__main__":
    unittest.main()


class ChainErrors(unittest.TestCase):
    def test_first_bad_block_decides_the_error(self):
        # Block 0 holds a token out of range, block 1 one of another type:
        # the first block's error, as a block at a time reported it.
        with self.assertRaises(kvoffload.InvalidArgumentError):
            kvoffload.chain_keys([1, -1, 3, 4, 1.5, 6], 2)
        with self.assertRaises(kvoffload.ArgumentTypeError):
            kvoffload.chain_keys([1, 2, True, 3, -1, 6], 2)
        # A partial last block is not checked (it gets no key).
        self.assertEqual(len(kvoffload.chain_keys([1, 2, 3, -1], 3)), 1)
