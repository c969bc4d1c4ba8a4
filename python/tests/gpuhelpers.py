"""What the GPU tests share: torch when it is installed, and the gpu_test
class decorator. Without the library, torch or a CUDA device the test
class is skipped; with KVO_REQUIRE_GPU=1 it fails instead, so that a skip
on the GPU machine is a failure. Kept apart from helpers so that the CPU
tests never import torch."""

import os
import unittest

from .helpers import have_library

REQUIRE = os.environ.get("KVO_REQUIRE_GPU") == "1"

try:
    import torch
    HAVE_GPU = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_GPU = False


def _skip_reason():
    if not have_library():
        return "no libkvoffload.so"
    if torch is None:
        return "no torch"
    if not HAVE_GPU:
        return "no CUDA device"
    return None


def gpu_test(cls):
    reason = _skip_reason()
    if reason is None:
        return cls
    if REQUIRE:
        def setUp(self):
            self.fail(f"KVO_REQUIRE_GPU=1 but {reason}")
        cls.setUp = setUp
        return cls
    return unittest.skip(reason)(cls)
