"""scripts/build_wheel.py, the stdlib wheel builder: the platform tag from
a library's ELF, __version__ rewriting, and a wheel whose RECORD matches
its files (a wheel built from a stand-in library, so no Go is needed)."""

import base64
import hashlib
import os
import sys
import tempfile
import unittest
import zipfile

import kvoffload
from kvoffload import _lib

from .helpers import REPO, load_script, needs_library

SCRIPT = os.path.join(REPO, "scripts", "build_wheel.py")


def load():
    return load_script(SCRIPT)


def real_elf():
    """An x86_64/aarch64 ELF linked against glibc: this interpreter."""
    path = os.path.realpath(sys.executable)
    with open(path, "rb") as f:
        data = f.read()
    return data if data[:4] == b"\x7fELF" else None


@unittest.skipUnless(os.path.exists(SCRIPT), "no scripts/build_wheel.py beside the tests")
class WheelBuilder(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.bw = load()

    def test_set_version(self):
        src = 'x = 1\n__version__ = "0.0.0"\ny = 2\n'
        self.assertEqual(self.bw.set_version(src, "1.2.3"), 'x = 1\n__version__ = "1.2.3"\ny = 2\n')
        with self.assertRaises(ValueError):
            self.bw.set_version("x = 1\n", "1.2.3")

    def test_record_hash(self):
        want = base64.urlsafe_b64encode(hashlib.sha256(b"abc").digest()).rstrip(b"=").decode()
        self.assertEqual(self.bw.record_hash(b"abc"), "sha256=" + want)
        self.assertNotIn("=", self.bw.record_hash(b"abc")[len("sha256="):])

    def test_not_elf(self):
        with self.assertRaises(self.bw.ElfError):
            self.bw.platform_tag(b"#!/bin/sh\n")
        with self.assertRaises(self.bw.ElfError):
            self.bw.platform_tag(b"\x7fELF\x01\x01" + bytes(64))  # 32-bit

    def test_platform_tag_of_a_glibc_binary(self):
        data = real_elf()
        if data is None or self.bw.elf_facts(data)[0] not in ("x86_64", "aarch64"):
            self.skipTest("the interpreter is not an x86_64/aarch64 ELF")
        arch, needed, versions = self.bw.elf_facts(data)
        self.assertIn("libc.so.6", needed)
        self.assertTrue(any(v.startswith("GLIBC_") for _, v in versions))
        newest = max(tuple(int(x) for x in v[6:].split(".")[:2]) for _, v in versions if v.startswith("GLIBC_2"))
        if all(n in self.bw.ALLOWED_NEEDED for n in needed):
            self.assertEqual(self.bw.platform_tag(data), f"manylinux_{newest[0]}_{newest[1]}_{arch}")

    def test_refuses_other_libraries(self):
        data = real_elf()
        if data is None:
            self.skipTest("the interpreter is not an ELF")
        _, needed, _ = self.bw.elf_facts(data)
        old = self.bw.ALLOWED_NEEDED
        try:
            self.bw.ALLOWED_NEEDED = set()
            if needed:
                with self.assertRaises(self.bw.ElfError):
                    self.bw.platform_tag(data)
        finally:
            self.bw.ALLOWED_NEEDED = old

    def test_wheel_files_record(self):
        with tempfile.TemporaryDirectory() as d:
            pkg = os.path.join(d, "kvoffload")
            os.mkdir(pkg)
            with open(os.path.join(pkg, "__init__.py"), "w") as f:
                f.write('__version__ = "9.9.9"\n')
            with open(os.path.join(pkg, "engine.py"), "w") as f:
                f.write("pass\n")
            with open(os.path.join(pkg, "libkvoffload.so"), "w") as f:
                f.write("stale copy: not shipped from the package folder\n")
            sub = os.path.join(pkg, "integrations")
            os.makedirs(os.path.join(sub, "__pycache__"))
            for name in ("__init__.py", "transformers.py"):
                with open(os.path.join(sub, name), "w") as f:
                    f.write('__version__ = "0"\n')  # a subpackage's __init__ is shipped as it is
            with open(os.path.join(sub, "__pycache__", "transformers.cpython-311.pyc"), "w") as f:
                f.write("compiled\n")
            os.mkdir(os.path.join(pkg, "notapackage"))
            with open(os.path.join(pkg, "notapackage", "x.py"), "w") as f:
                f.write("pass\n")
            files = self.bw.wheel_files("1.2.3", b"\x7fELF lib", "manylinux_2_34_x86_64", pkg)
        names = [n for n, _, _ in files]
        self.assertEqual([n for n in names if n.endswith(".py")],
                         ["kvoffload/__init__.py", "kvoffload/engine.py", "kvoffload/integrations/__init__.py",
                          "kvoffload/integrations/transformers.py"])
        self.assertEqual(names.count("kvoffload/libkvoffload.so"), 1)
        self.assertEqual(names[-1], "kvoffload-1.2.3.dist-info/RECORD")
        byname = {n: data for n, data, _ in files}
        self.assertEqual(byname["kvoffload/__init__.py"], b'__version__ = "1.2.3"\n')
        self.assertEqual(byname["kvoffload/integrations/__init__.py"], b'__version__ = "0"\n')
        self.assertEqual(byname["kvoffload/libkvoffload.so"], b"\x7fELF lib")
        wheel = byname["kvoffload-1.2.3.dist-info/WHEEL"].decode()
        self.assertIn("Root-Is-Purelib: false\n", wheel)
        self.assertIn("Tag: py3-none-manylinux_2_34_x86_64\n", wheel)
        self.assertIn("Version: 1.2.3\n", byname["kvoffload-1.2.3.dist-info/METADATA"].decode())
        rows = [line.split(",") for line in byname["kvoffload-1.2.3.dist-info/RECORD"].decode().splitlines()]
        self.assertEqual(sorted(r[0] for r in rows), sorted(names))
        for name, digest, size in rows:
            if name.endswith("/RECORD"):
                self.assertEqual((digest, size), ("", ""))
                continue
            self.assertEqual(digest, self.bw.record_hash(byname[name]), name)
            self.assertEqual(int(size), len(byname[name]), name)

    @needs_library
    def test_build_writes_a_zip(self):
        with open(_lib.library_path(), "rb") as f:
            data = f.read()
        root = os.path.dirname(os.path.dirname(SCRIPT))
        if not os.path.exists(os.path.join(root, "internal", "version", "VERSION")):
            self.skipTest("no source tree")
        with tempfile.TemporaryDirectory() as d:
            lib = os.path.join(d, "lib.so")
            with open(lib, "wb") as f:
                f.write(data)
            # The package imported (the source tree's or an installed copy's).
            pkg = os.path.dirname(os.path.abspath(kvoffload.__file__))
            path = self.bw.build(lib, os.path.join(d, "dist"), root=root, pkg_dir=pkg)
            version = self.bw.read_version(root)
            self.assertTrue(os.path.basename(path).startswith(f"kvoffload-{version}-py3-none-manylinux_"))
            with zipfile.ZipFile(path) as z:
                self.assertIsNone(z.testzip())
                info = z.getinfo("kvoffload/libkvoffload.so")
                self.assertEqual((info.external_attr >> 16) & 0o777, 0o755)
                self.assertIn(f'__version__ = "{version}"', z.read("kvoffload/__init__.py").decode())


if __name__ == "__main__":
    unittest.main()
