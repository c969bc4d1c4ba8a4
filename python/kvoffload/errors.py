"""Exceptions raised by kvoffload. Every error from the library is a
KvoError subclass carrying the library's message (which names the bad value
and the limit it broke) and its KVO_* code."""

KVO_OK = 0
KVO_EINVAL = -1
KVO_ECLOSED = -2
KVO_EBUSY = -3
KVO_ENODRIVER = -4
KVO_ENOMEM = -5
KVO_ERELEASED = -6
KVO_ECAPTURING = -7
KVO_EFAIL = -8
KVO_ETIMEOUT = -9
KVO_EFORK = -10
KVO_ENOTDONE = -11
KVO_EGROWTH = -12
KVO_EUNAVAILABLE = -13


class KvoError(Exception):
    """Base of every kvoffload error; .code is the KVO_* code (0 for errors
    raised by the Python layer itself)."""

    code = 0

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(KvoError, ValueError):
    """Bad input: key length, block id, tensor device/shape/contiguity, config."""
    code = KVO_EINVAL


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a bool or a str where an int is
    expected, None for keys): an InvalidArgumentError that is also a
    TypeError."""


class EngineClosedError(KvoError):
    """The engine was closed."""
    code = KVO_ECLOSED


class BusyError(KvoError):
    """The engine's queue is full; a load failed fast."""
    code = KVO_EBUSY


class NoDriverError(KvoError):
    """The CUDA backend was asked for but no driver or device is available."""
    code = KVO_ENODRIVER


class OutOfMemoryError(KvoError, MemoryError):
    """The machine cannot hold the pool, or the staging region is full."""
    code = KVO_ENOMEM


class ReleasedError(KvoError):
    """The op or lease was already released (or taken over by a load)."""
    code = KVO_ERELEASED


class CapturingError(KvoError):
    """A store's stream is capturing a CUDA graph."""
    code = KVO_ECAPTURING


class TransferFailedError(KvoError):
    """A copy or the driver failed."""
    code = KVO_EFAIL


class OpTimeoutError(KvoError, TimeoutError):
    """An op was not done within the timeout given to wait()."""
    code = KVO_ETIMEOUT


class ForkedChildError(KvoError):
    """Called in a forked child of the process that loaded the library."""
    code = KVO_EFORK


class NotDoneError(KvoError):
    """Outcomes asked for before the op was done."""
    code = KVO_ENOTDONE


class GrowthError(KvoError):
    """Background growth of the pool stopped on an error (Engine.wait_grown);
    the engine keeps working with the regions pinned so far."""
    code = KVO_EGROWTH


class UnavailableError(KvoError):
    """An engine of Engine.connect cannot reach its node (not started, gone
    or restarting): load() raises it, lookup() finds nothing meanwhile and
    store() reports its blocks "refused-busy"; the engine reconnects by
    itself."""
    code = KVO_EUNAVAILABLE


class LibraryError(KvoError):
    """libkvoffload.so could not be found or loaded."""


class AbiVersionError(LibraryError):
    """The library speaks another ABI version than this package."""


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgumentError, EngineClosedError, BusyError, NoDriverError, OutOfMemoryError,
    ReleasedError, CapturingError, TransferFailedError, OpTimeoutError, ForkedChildError, NotDoneError, GrowthError,
    UnavailableError)}


def from_code(code, message):
    """The exception for a KVO_* code."""
    cls = _BY_CODE.get(code, KvoError)
    return cls(message, code)
