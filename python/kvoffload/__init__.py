"""kvoffload: offload KV-cache blocks between GPU memory and a pinned host
pool, from Python (ctypes over libkvoffload.so; no compiled extension).

    import kvoffload
    eng = kvoffload.Engine.from_tensors(kv_caches, pool_bytes=64 << 30, namespace="llama-3-8b/bf16",
                                        model_kv_heads=8, head_first=tp_rank * 8 // tp_size)  # any TP size shares blocks
    keys = eng.keys(token_ids)                     # same keys as Go's kvcache.ChainKeys
    with eng.store(keys, block_ids, after=torch.cuda.current_stream()) as op:
        op.wait_stream(torch.cuda.current_stream())  # before the blocks are overwritten
    hits, lease = eng.lookup(keys, lease=True)
    op = eng.load(keys[:hits], free_ids[:hits], lease=lease)
    op.wait_stream(torch.cuda.current_stream())      # before attention reads them

Importing this package loads nothing: the library (and the Go runtime in
it) is loaded by the first Engine. chain_keys and block_key need neither
the library nor torch. See _lib for how the library is loaded (signals,
GOMAXPROCS, fork).
"""

from .engine import OUTCOMES, Engine, Lease, Op, Staging, abi_version, library_pid
from .errors import (AbiVersionError, ArgumentTypeError, BusyError, CapturingError, EngineClosedError, ForkedChildError, GrowthError,
                     InvalidArgumentError, KvoError, LibraryError, NoDriverError, NotDoneError, OpTimeoutError,
                     OutOfMemoryError, ReleasedError, TransferFailedError, UnavailableError)
from .keys import KEY_BYTES, ZERO_KEY, block_key, chain_keys
from .version import library_version

# The release version: internal/version/VERSION (the wheel builder writes it here too).
__version__ = "0.1.0"

__all__ = [
    "Engine", "Op", "Lease", "Staging", "OUTCOMES", "abi_version", "library_pid", "library_version",
    "block_key", "chain_keys", "KEY_BYTES", "ZERO_KEY",
    "KvoError", "InvalidArgumentError", "ArgumentTypeError", "EngineClosedError", "BusyError", "NoDriverError", "OutOfMemoryError",
    "ReleasedError", "CapturingError", "TransferFailedError", "OpTimeoutError", "ForkedChildError",
    "NotDoneError", "GrowthError", "UnavailableError", "LibraryError", "AbiVersionError",
]
