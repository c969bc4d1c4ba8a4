"""The release version: __version__ equals internal/version/VERSION (when
the source tree is there), and the library reports the same one."""

import os
import re
import unittest

import kvoffload

from .helpers import have_library

VERSION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "internal", "version", "VERSION")


class Version(unittest.TestCase):
    def test_format(self):
        self.assertRegex(kvoffload.__version__, r"^\d+\.\d+\.\d+$")

    def test_matches_version_file(self):
        if not os.path.exists(VERSION_FILE):
            self.skipTest("no internal/version/VERSION beside the tests")
        with open(VERSION_FILE) as f:
            want = f.read().strip()
        self.assertEqual(kvoffload.__version__, want, "python/kvoffload/__init__.py and internal/version/VERSION disagree")

    @unittest.skipUnless(have_library(), "no library")
    def test_library_version(self):
        self.assertEqual(kvoffload.library_version(), kvoffload.__version__)

    def test_single_assignment(self):
        init = os.path.join(os.path.dirname(os.path.abspath(kvoffload.__file__)), "__init__.py")
        with open(init) as f:
            self.assertEqual(len(re.findall(r"^__version__ = ", f.read(), re.M)), 1)


if __name__ == "__main__":
    unittest.main()
