"""The library's release version (kvo_version()), beside the package's
__version__: both come from internal/version/VERSION."""

import ctypes

from . import _lib


def library_version():
    """The release version of the loaded libkvoffload.so ("0.1.0"), loading
    it if needed; None for a library too old to report one (the ABI version,
    abi_version(), is what decides whether a library can be used)."""
    lib = _lib.get()
    fn = getattr(lib, "kvo_version", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    v = fn()
    return v.decode("utf-8", "replace") if v else None
