"""What the bench probes call beside torch (bench/probes/probe_2d_dma.py,
bench/probes/probe_layer_dma.py): libcuda's pitched copy (cuMemcpy2DAsync_v2)
through ctypes, and the timing of a function's work on a stream with
torch's CUDA events. Runs only where libcuda and torch are (the GPU
machine)."""
import ctypes
import statistics
import sys

import torch

cu = ctypes.CDLL("libcuda.so.1")


class MEMCPY2D(ctypes.Structure):
    """CUDA_MEMCPY2D."""
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


HOST, DEVICE = 1, 2  # CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE
cu.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(MEMCPY2D), ctypes.c_void_p]


def check(r, what):
    """Exits naming what failed when a driver call returned an error."""
    if r != 0:
        sys.exit(f"{what}: CUresult {r}")


def copy2d(ds, stream):
    """Enqueues the 2-D copies ds on stream (a torch.cuda.Stream)."""
    sp = ctypes.c_void_p(stream.cuda_stream)
    for d in ds:
        check(cu.cuMemcpy2DAsync_v2(ctypes.byref(d), sp), "cuMemcpy2DAsync")


def timed(stream, fn, reps=5):
    """Runs fn (which enqueues work on stream) reps + 1 times between two
    timing events and returns the best and the median ms of all but the
    first (a warm-up)."""
    ts = []
    for _ in range(reps + 1):
        a = torch.cuda.Event(enable_timing=True)
        z = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record(stream)
            fn()
            z.record(stream)
        z.synchronize()
        ts.append(a.elapsed_time(z))
    return min(ts[1:]), statistics.median(ts[1:])
