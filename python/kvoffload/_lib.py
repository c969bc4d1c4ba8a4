"""Loading libkvoffload.so and calling it: the only module that uses ctypes
on the library.

The library is loaded lazily, on the first call that needs it (creating an
Engine, abi_version()), so that importing kvoffload starts no Go runtime.
Loading it:

* changes nothing in os.environ: the library itself caps the Go runtime's
  GOMAXPROCS (the threads running Go code at once) at min(CPUs available,
  8) unless the GOMAXPROCS environment variable is set, in which case the
  runtime uses that (stats()["go_maxprocs"] shows the value in effect);
* blocks the asynchronous signals (SIGINT, SIGTERM, SIGHUP, ...) in the
  loading thread while the library's constructor starts the Go runtime, so
  that every thread the runtime creates, then and later, keeps them blocked
  for good: the kernel then delivers them to Python's threads, and Python's
  handlers (KeyboardInterrupt, signal.signal) work as without the library.
  The mask of the calling thread is restored right after;
* checks kvo_abi_version() against the version this package speaks.

Every call is checked for a fork: a child of fork has a Go runtime whose
threads are gone, and the library refuses it (KVO_EFORK) before running any
Go code; the error is raised as ForkedChildError.
"""

import ctypes
import math
import operator
import os
import signal
import threading

from . import errors

ABI_VERSION = 4  # KVO_ABI_VERSION of capi/kvoffload.h
_LIB_NAME = "libkvoffload.so"

# The asynchronous signals kept off the Go runtime's threads. Synchronous
# signals (SIGSEGV, SIGBUS, SIGFPE...) and SIGPIPE are the runtime's own;
# SIGURG is its preemption signal.
_BLOCKED_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                 "SIGALRM", "SIGCHLD", "SIGWINCH", "SIGIO", "SIGVTALRM", "SIGXCPU", "SIGXFSZ")
    if hasattr(signal, name)
)

_u8p = ctypes.POINTER(ctypes.c_uint8)
_u64 = ctypes.c_uint64
_u64p = ctypes.POINTER(ctypes.c_uint64)
_i64 = ctypes.c_int64
_uptr = ctypes.c_size_t  # uintptr_t
_uptrp = ctypes.POINTER(ctypes.c_size_t)
_size = ctypes.c_size_t
_sizep = ctypes.POINTER(ctypes.c_size_t)
_int = ctypes.c_int
_vp = ctypes.c_void_p

# The ranges of the C types of the prototypes below. ctypes converts a
# Python int out of its type's range silently (modulo 2**bits), so every
# integer a caller gives is checked against these first (check_int).
INT_MIN, INT_MAX = -(1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)), (1 << (8 * ctypes.sizeof(ctypes.c_int) - 1)) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
UINTPTR_MAX = SIZE_MAX  # uintptr_t is declared as c_size_t

# name: argument types; every function returns int (an error code) unless
# listed in _RESTYPES.
_PROTOTYPES = {
    "kvo_abi_version": [],
    "kvo_last_error": [],
    "kvo_engine_create": [ctypes.c_char_p, _u64p],
    "kvo_engine_connect": [ctypes.c_char_p, ctypes.c_char_p, _u64p],
    "kvo_engine_destroy": [_u64],
    "kvo_engine_config_json": [_u64, ctypes.c_char_p, _size, _sizep],
    "kvo_lookup": [_u64, _vp, _size, _int, _sizep, _u64p],
    "kvo_store": [_u64, _vp, _vp, _size, _vp, _vp, _uptr, _uptr, _u64p],
    "kvo_load": [_u64, _vp, _vp, _size, _u64, _uptr, _int, _uptr, _u64p],
    "kvo_op_wait": [_u64, _i64],
    "kvo_op_query": [_u64, ctypes.POINTER(_int)],
    "kvo_op_stream_wait": [_u64, _uptr],
    "kvo_op_event": [_u64, _uptrp],
    "kvo_op_layer_event": [_u64, _int, _uptrp],
    "kvo_op_outcomes": [_u64, _vp, _size],
    "kvo_op_release": [_u64],
    "kvo_lease_release": [_u64],
    "kvo_staging": [_u64, ctypes.c_char_p, _u64, ctypes.POINTER(_vp), _u64p],
    "kvo_stats_json": [_u64, ctypes.c_char_p, _size, _sizep],
    "kvo_trim": [_u64, _u64, _i64, _u64p, _u64p],
    "kvo_delete": [_u64, _vp, _size, _sizep],
    "kvo_clear": [_u64, ctypes.c_char_p, _sizep],
    "kvo_chain_keys": [_vp, _size, _vp, _vp, _size, _size, _vp, _size, _sizep],
    "kvo_sim_write": [_u64, _u64, _vp, _size],
    "kvo_sim_read": [_u64, _u64, _vp, _size],
    "kvo_wait_grown": [_u64, _i64],
    "kvo_pause_growth": [_u64],
    "kvo_resume_growth": [_u64],
    "kvo_metrics_text": [_u64, ctypes.c_char_p, _size, _sizep],
    "kvo_events_open": [_u64, _i64],
    "kvo_events_poll": [_u64, ctypes.c_char_p, _size, _sizep],
    "kvo_events_dropped": [_u64, _u64p],
    "kvo_events_close": [_u64],
    "kvo_store_tokens": [_u64, _vp, _vp, _size, _vp, _vp, _vp, _size, _uptr, _uptr, _u64p],
    "kvo_prefetch": [_u64, _vp, _size, _i64, _sizep, _sizep, _sizep],
    "kvo_prefetch_background": [_u64, _vp, _size, _i64, ctypes.POINTER(_int)],
}
_RESTYPES = {"kvo_last_error": ctypes.c_char_p}

_lock = threading.Lock()
_lib = None
_loaded_pid = None


def library_path():
    """The library this package loads: $KVOFFLOAD_LIB, else libkvoffload.so
    next to the package (capi/build.sh puts it there)."""
    env = os.environ.get("KVOFFLOAD_LIB")
    if env:
        return env
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), _LIB_NAME)


def load_library(path):
    """Loads the library at path with the signal mask described above, checks its ABI version and declares its prototypes.
    Raises LibraryError when the file cannot be loaded and AbiVersionError
    for a library of another ABI version. Loading one library twice is
    harmless (the dynamic loader returns the same one)."""
    if not os.path.exists(path):
        raise errors.LibraryError(
            f"kvoffload: no library at {path!r}: build it with capi/build.sh "
            f"(go build -buildmode=c-shared -o build/libkvoffload.so ./capi) or set KVOFFLOAD_LIB")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED_SIGNALS)
    try:
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise errors.LibraryError(f"kvoffload: cannot load {path!r}: {e}") from e
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        version = lib.kvo_abi_version
    except AttributeError as e:
        raise errors.AbiVersionError(f"kvoffload: {path!r} has no kvo_abi_version: not a kvoffload library") from e
    version.restype = ctypes.c_int
    version.argtypes = []
    got = version()
    if got != ABI_VERSION:
        raise errors.AbiVersionError(
            f"kvoffload: {path!r} speaks ABI version {got}, this package speaks {ABI_VERSION}: "
            f"rebuild the library from the same checkout (capi/build.sh)")
    for name, argtypes in _PROTOTYPES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as e:
            raise errors.AbiVersionError(f"kvoffload: {path!r} lacks {name} although it claims ABI {got}") from e
        fn.argtypes = argtypes
        fn.restype = _RESTYPES.get(name, ctypes.c_int)
    return lib


def get():
    """The loaded library, loading it on first use."""
    global _lib, _loaded_pid
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is None:
            lib = load_library(library_path())
            _loaded_pid = os.getpid()
            _lib = lib
    return _lib


def loaded():
    """Whether the library has been loaded in this process (or its parent)."""
    return _lib is not None


def in_loading_process():
    """False in a forked child of the process that loaded the library."""
    return _loaded_pid == os.getpid()


def last_error(lib):
    msg = lib.kvo_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check_int(name, value, lo, hi):
    """value as an int, checked before ctypes converts it (which would
    truncate it silently): ArgumentTypeError (a TypeError) naming name for
    a bool or a non-integer (objects with __index__, like numpy integers,
    are integers), InvalidArgumentError (a ValueError) naming the value and
    the limit for one outside [lo, hi]."""
    if isinstance(value, bool):
        raise errors.ArgumentTypeError(f"kvoffload: {name} must be an integer, got a bool ({value!r})")
    try:
        v = operator.index(value)
    except TypeError:
        raise errors.ArgumentTypeError(
            f"kvoffload: {name} must be an integer, got {type(value).__name__} ({value!r:.40})") from None
    if v < lo:
        raise errors.InvalidArgumentError(f"kvoffload: {name} = {v} is below {lo}, the least it may be")
    if v > hi:
        raise errors.InvalidArgumentError(f"kvoffload: {name} = {v} is above {hi}, the most it may be")
    return v


def c_string(name, value):
    """value (str, encoded as UTF-8, or bytes) as the bytes of a
    NUL-terminated C string: a NUL byte inside would silently end the string
    the library sees, so it is InvalidArgumentError (a ValueError) naming
    name; any other type is ArgumentTypeError (a TypeError)."""
    if isinstance(value, str):
        raw = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
    else:
        raise errors.ArgumentTypeError(f"kvoffload: {name} must be a str, got {type(value).__name__} ({value!r:.40})")
    i = raw.find(b"\0")
    if i >= 0:
        raise errors.InvalidArgumentError(
            f"kvoffload: {name} {value!r:.60} has a NUL byte at {i}: the library takes it as a NUL-terminated C string")
    return raw


def timeout_ns(name, timeout):
    """A timeout in seconds (an int or float; None: no limit) as the
    int64_t nanoseconds the library takes: -1 for None, 0 for a negative
    one, INT64_MAX (about 292 years) for one above it or infinite. NaN or a
    non-number: InvalidArgumentError / ArgumentTypeError naming name."""
    if timeout is None:
        return -1
    bad = errors.ArgumentTypeError(f"kvoffload: {name} must be a number of seconds or None, got "
                                   f"{type(timeout).__name__} ({timeout!r:.40})")
    if isinstance(timeout, (bool, str, bytes, bytearray)):
        raise bad
    try:
        t = float(timeout)
    except OverflowError:  # an int beyond float's range
        t = math.inf if timeout > 0 else -math.inf
    except (TypeError, ValueError):
        raise bad from None
    if math.isnan(t):
        raise errors.InvalidArgumentError(f"kvoffload: {name} is NaN, must be a number of seconds or None")
    if t <= 0:
        return 0
    if t >= INT64_MAX / 1e9:
        return INT64_MAX
    return int(t * 1e9)


def check(rc, call):
    """Raises the KvoError subclass for a non-zero code, with the library's
    text. Must run on the thread that made the call (the text is per
    thread)."""
    if rc != 0:
        raise errors.from_code(rc, last_error(get()) or f"kvoffload: {call} failed with code {rc}")
