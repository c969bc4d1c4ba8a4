"""Shared helpers for the host-backend tests: a small engine config and
block reads/writes through the simulated GPU."""

import importlib.util
import os
import unittest

import kvoffload
from kvoffload import _lib

LAYERS, HEADS, DIM, DTYPE, TPB, NUM_BLOCKS = 2, 2, 8, 2, 4, 64
SEG = TPB * HEADS * DIM * DTYPE


def host_config(**over):
    cfg = {
        "pool_bytes": 1 << 20, "backend": "host", "skip_memory_check": True, "policy": "lru",
        "staging_bytes": 1 << 16, "namespace": "py-test",
        "layout": {"kind": "layer-separate", "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM,
                   "dtype_bytes": DTYPE, "tokens_per_block": TPB, "num_blocks": NUM_BLOCKS},
    }
    cfg.update(over)
    return cfg


def have_library():
    return os.path.exists(_lib.library_path())


def needs_library(cls):
    return unittest.skipUnless(have_library(), f"no library at {_lib.library_path()} (capi/build.sh)")(cls)


def segments(eng, block):
    for t in eng.config["layout"]["layer_tensors"]:
        yield t["k"] + block * t["stride"]
        yield t["v"] + block * t["stride"]


def pattern(block, salt):
    return bytes((block * 31 + salt * 7 + i) % 251 for i in range(SEG))


def write_block(eng, block, salt):
    for s, addr in enumerate(segments(eng, block)):
        eng.sim_write(addr, pattern(block, salt + s))


def block_holds(eng, block, src, salt):
    return all(eng.sim_read(addr, SEG) == pattern(src, salt + s) for s, addr in enumerate(segments(eng, block)))


def keys_for(n, seed):
    return kvoffload.chain_keys(range(seed * 100000, seed * 100000 + n * TPB), TPB, namespace="py-test")


def small_config(blocks, **over):
    """A host engine whose pool holds exactly blocks blocks (4 KiB each:
    head_dim 64), in one region (unless over says otherwise)."""
    cfg = host_config(**dict({"pool_bytes": blocks * 4096, "first_region_bytes": blocks * 4096, "staging_bytes": 4096},
                             **over))
    cfg["layout"] = dict(cfg["layout"], head_dim=64, num_blocks=8)
    return cfg


# The repository's root, seen from python/tests (also in wheel_test.sh's
# copy, laid out the same way).
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def load_script(path):
    """Imports the script at path (absolute, or relative to the repository:
    bench/realmodel.py) as a module named after it, without running its
    main."""
    path = os.path.join(REPO, path)
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
