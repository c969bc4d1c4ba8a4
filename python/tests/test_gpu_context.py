"""GPU tests (torch, a CUDA device): the engine's calls run on the calling
Python thread, and must leave that thread's current CUDA context, and with
it torch's current device, as they were (issue 18 item 5). Each case sets
up the thread's context, then creates an engine, stores, loads, takes a
staging buffer, trims and closes, and compares the context (cuCtxGetCurrent
through ctypes on libcuda) after every step:

- device 0's primary context current (torch's), engine on device 0;
- no context current, engine on device 0;
- a context of the test's own on device 0 current (cuCtxCreate), engine on
  device 0's primary context: on one GPU, the case the old code failed;
- with two GPUs (KVO_MULTI_GPU=1), torch on device 0 and the engine on
  device 1.

Skipped without torch or a GPU; with KVO_REQUIRE_GPU=1 a skip is a failure.
"""

import ctypes
import os
import unittest

import kvoffload

from .gpuhelpers import gpu_test, torch


LAYERS, HEADS, DIM, TPB = 2, 8, 128, 16
N = 8  # blocks stored and loaded
BLOCKS = 2 * N
BLOCK_BYTES = LAYERS * 2 * TPB * HEADS * DIM * 2
POOL = 4 * N * BLOCK_BYTES


_cuda = None


def cuda():
    """libcuda, for the driver's view of the thread's context."""
    global _cuda
    if _cuda is None:
        lib = ctypes.CDLL("libcuda.so.1")
        ptr, ctx = ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p
        for name, args in (("cuCtxGetCurrent", [ptr]), ("cuCtxSetCurrent", [ctx]),
                           ("cuDeviceGet", [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
                           ("cuCtxCreate_v2", [ptr, ctypes.c_uint, ctypes.c_int]), ("cuCtxDestroy_v2", [ctx])):
            f = getattr(lib, name, None)
            if f is not None:
                f.argtypes, f.restype = args, ctypes.c_int
        _cuda = lib
    return _cuda


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def ctx_get():
    """The calling thread's current CUcontext as an int (0: none)."""
    c = ctypes.c_void_p(0)
    _check(cuda().cuCtxGetCurrent(ctypes.byref(c)), "cuCtxGetCurrent")
    return c.value or 0


def ctx_set(c):
    _check(cuda().cuCtxSetCurrent(c or None), "cuCtxSetCurrent")


@gpu_test
class CallerContext(unittest.TestCase):
    def setUp(self):
        torch.cuda.set_device(0)
        torch.zeros(1, device="cuda:0")  # torch's context on device 0, current on this thread
        self.torch_ctx = ctx_get()
        self.assertNotEqual(self.torch_ctx, 0, "torch made no context current")
        # Whatever a case does to the thread's context, the next starts from torch's.
        self.addCleanup(torch.cuda.set_device, 0)
        self.addCleanup(ctx_set, self.torch_ctx)

    def kv(self, device):
        return [(torch.zeros(BLOCKS, TPB, HEADS, DIM, dtype=torch.bfloat16, device=device),
                 torch.zeros(BLOCKS, TPB, HEADS, DIM, dtype=torch.bfloat16, device=device))
                for _ in range(LAYERS)]

    def steps(self, kv, want_ctx, want_device=None):
        """Runs the engine's calls on this thread with want_ctx current,
        checking the context after each; want_device (torch's current
        device) is checked after each step too when given, else once at
        the end by the caller (torch may bind a context to answer)."""
        def check(step):
            self.assertEqual(ctx_get(), want_ctx,
                             f"the thread's current context after {step}: {ctx_get():#x}, was {want_ctx:#x}")
            if want_device is not None:
                self.assertEqual(torch.cuda.current_device(), want_device, f"torch's current device after {step}")

        self.assertEqual(ctx_get(), want_ctx)
        eng = kvoffload.Engine.from_tensors(kv, pool_bytes=POOL, first_region_bytes=POOL,
                                            namespace="ctx-test", policy="lru", staging_bytes=1 << 16)
        try:
            check("Engine creation")
            keys = eng.keys(range(N * TPB))
            op = eng.store(keys, range(N))
            self.assertEqual(op.wait(), ["stored"] * N)
            op.release()
            check("store")
            op = eng.load(keys, range(N, 2 * N))
            self.assertEqual(op.wait(), ["loaded"] * N)
            op.release()
            check("load")
            eng.staging("logits", 4096)
            check("staging")
            res = eng.trim(POOL)
            self.assertGreater(res["freed_bytes"] + res["pending_bytes"], 0, res)
            check("trim")
        finally:
            eng.close()
        check("close")

    def test_primary_context_of_device_0(self):
        self.steps(self.kv("cuda:0"), self.torch_ctx, want_device=0)

    def test_no_context_current(self):
        kv = self.kv("cuda:0")
        ctx_set(0)
        self.steps(kv, 0)
        self.assertEqual(torch.cuda.current_device(), 0)

    def test_own_context_on_device_0(self):
        kv = self.kv("cuda:0")
        create = getattr(cuda(), "cuCtxCreate_v2", None)
        destroy = getattr(cuda(), "cuCtxDestroy_v2", None)
        if create is None or destroy is None:
            self.skipTest("libcuda exports no cuCtxCreate_v2/cuCtxDestroy_v2")
        dev = ctypes.c_int(0)
        _check(cuda().cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        own = ctypes.c_void_p(0)
        _check(create(ctypes.byref(own), 0, dev.value), "cuCtxCreate_v2")  # pushed: current now
        self.addCleanup(lambda: _check(destroy(own), "cuCtxDestroy_v2"))
        self.assertNotEqual(own.value, self.torch_ctx)
        self.steps(kv, own.value)
        self.assertEqual(torch.cuda.current_device(), 0)

    def multi_gpu_engine_on_device_1(self):
        """Two GPUs: torch on device 0, the engine on device 1. Not part of
        the default run (load_tests below); KVO_MULTI_GPU=1 runs it and then
        fails on a machine with fewer than two GPUs."""
        self.assertGreaterEqual(torch.cuda.device_count(), 2, "KVO_MULTI_GPU=1 needs two CUDA devices")
        kv = self.kv("cuda:1")  # torch switches to device 1 for the allocation, and back
        self.assertEqual(torch.cuda.current_device(), 0)
        self.assertEqual(ctx_get(), self.torch_ctx)
        self.steps(kv, self.torch_ctx, want_device=0)


def load_tests(loader, tests, pattern):
    """The device-1 case belongs to the two-GPU run (KVO_MULTI_GPU=1), so
    that a one-GPU machine neither skips it nor fails it."""
    if os.environ.get("KVO_MULTI_GPU") == "1":
        tests.addTest(CallerContext("multi_gpu_engine_on_device_1"))
    return tests


if __name__ == "__main__":
    unittest.main()
