#!/usr/bin/env python3
"""Builds the kvoffload wheel with the standard library only (no `wheel`,
`build` or `auditwheel` here):

    dist/kvoffload-<version>-py3-none-manylinux_<glibc>_<arch>.whl

holding the pure-Python package (python/kvoffload/**.py, ctypes only: one
wheel serves every Python 3) and libkvoffload.so beside it, where the
package looks for the library. <version> is internal/version/VERSION, also
written into the wheel's kvoffload/__init__.py as __version__.

The platform tag is derived from the library itself, as auditwheel would:
<glibc> is the newest GLIBC_x.y symbol version the library needs (its
SHT_GNU_verneed section, what `objdump -T` or `readelf -V` show), <arch> its
ELF machine; and the libraries it links (DT_NEEDED) must all be among those
the manylinux policy lets a wheel assume (libc, libpthread, libdl, libm,
librt and the loader: libcuda is dlopened at run time, not linked).

    make wheel                                   # builds the library, then this
    python3 scripts/build_wheel.py --lib build/wheel/libkvoffload.so --out dist
    python3 scripts/build_wheel.py --tag-only --lib LIB   # print the platform tag
"""

import argparse
import base64
import hashlib
import io
import os
import re
import struct
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "kvoffload"
LIB_NAME = "libkvoffload.so"
SUMMARY = "KV-cache CPU offload for LLM serving: ctypes bindings over libkvoffload.so"
REQUIRES_PYTHON = ">=3.8"

# ELF e_machine -> wheel architecture.
ARCHES = {62: "x86_64", 183: "aarch64"}
# What a manylinux wheel may link without shipping (PEP 600's policy, as
# auditwheel's manylinux-policy.json lists it, the libraries that can occur).
ALLOWED_NEEDED = {
    "libc.so.6", "libpthread.so.0", "libdl.so.2", "libm.so.6", "librt.so.1", "libutil.so.1",
    "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "libgcc_s.so.1", "libresolv.so.2",
}

SHT_DYNAMIC = 6
SHT_GNU_VERNEED = 0x6FFFFFFE
DT_NEEDED = 1


class ElfError(ValueError):
    pass


def elf_facts(data):
    """(arch, needed libraries, set of (library, version name) it needs) of
    a 64-bit little-endian ELF shared object."""
    if data[:4] != b"\x7fELF":
        raise ElfError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    e_machine, = struct.unpack_from("<H", data, 18)
    e_shoff, = struct.unpack_from("<Q", data, 40)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 58)
    sections = []
    for i in range(e_shnum):
        (name, typ, flags, addr, off, size, link, info, align,
         entsize) = struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
        sections.append({"type": typ, "offset": off, "size": size, "link": link, "info": info})

    def cstr(strtab, off):
        base = sections[strtab]["offset"] + off
        end = data.index(b"\0", base)
        return data[base:end].decode("ascii", "replace")

    needed = []
    versions = set()
    for s in sections:
        if s["type"] == SHT_DYNAMIC:
            for off in range(s["offset"], s["offset"] + s["size"], 16):
                tag, val = struct.unpack_from("<qQ", data, off)
                if tag == 0:
                    break
                if tag == DT_NEEDED:
                    needed.append(cstr(s["link"], val))
        elif s["type"] == SHT_GNU_VERNEED:
            off = s["offset"]
            for _ in range(s["info"]):  # Elf64_Verneed entries
                _vn_version, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", data, off)
                lib = cstr(s["link"], vn_file)
                aoff = off + vn_aux
                for _ in range(vn_cnt):  # Elf64_Vernaux entries
                    _hash, _flags, _other, vna_name, vna_next = struct.unpack_from("<IHHII", data, aoff)
                    versions.add((lib, cstr(s["link"], vna_name)))
                    if vna_next == 0:
                        break
                    aoff += vna_next
                if vn_next == 0:
                    break
                off += vn_next
    if e_machine not in ARCHES:
        raise ElfError(f"ELF machine {e_machine} has no wheel architecture here")
    return ARCHES[e_machine], needed, versions


def platform_tag(data):
    """manylinux_<major>_<minor>_<arch> for the library's bytes, checking
    its linked libraries against the manylinux policy."""
    arch, needed, versions = elf_facts(data)
    bad = [n for n in needed if n not in ALLOWED_NEEDED]
    if bad:
        raise ElfError(f"links {', '.join(bad)}, which a manylinux wheel cannot assume")
    glibc = [tuple(int(x) for x in m.groups()) for _, v in versions
             for m in [re.fullmatch(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)?", v)] if m]
    if not glibc:
        raise ElfError("needs no GLIBC_ symbol version: not a glibc build?")
    major, minor = max(glibc)
    return f"manylinux_{major}_{minor}_{arch}"


def read_version(root=ROOT):
    with open(os.path.join(root, "internal", "version", "VERSION")) as f:
        v = f.read().strip()
    if not re.fullmatch(r"\d+\.\d+\.\d+", v):
        raise ValueError(f"internal/version/VERSION holds {v!r}, not MAJOR.MINOR.PATCH")
    return v


def set_version(init_py, version):
    """__init__.py's text with its one __version__ line set to version."""
    out, n = re.subn(r'(?m)^__version__ = "[^"]*"$', f'__version__ = "{version}"', init_py)
    if n != 1:
        raise ValueError(f"python/kvoffload/__init__.py has {n} __version__ lines, want 1")
    return out


def record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
    return f"sha256={digest}"


def metadata(version):
    readme = os.path.join(ROOT, "python", "README.md")
    body = ""
    if os.path.exists(readme):
        with open(readme) as f:
            body = f.read()
    head = (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\nSummary: {SUMMARY}\n"
            f"Requires-Python: {REQUIRES_PYTHON}\nClassifier: Programming Language :: Python :: 3\n"
            "Classifier: Operating System :: POSIX :: Linux\n")
    if body:
        head += "Description-Content-Type: text/markdown\n\n" + body
    return head


def package_sources(pkg_dir):
    """The package's .py files, relative to pkg_dir with / separators,
    sorted: the top level and its subpackages (folders holding an
    __init__.py, e.g. integrations/), never __pycache__."""
    out = []
    for dirpath, dirnames, filenames in os.walk(pkg_dir):
        rel = os.path.relpath(dirpath, pkg_dir)
        dirnames[:] = sorted(d for d in dirnames
                             if d != "__pycache__" and os.path.exists(os.path.join(dirpath, d, "__init__.py")))
        for name in filenames:
            if name.endswith(".py"):
                out.append(name if rel == "." else f"{rel.replace(os.sep, '/')}/{name}")
    return sorted(out)


def wheel_files(version, lib_bytes, tag, pkg_dir):
    """[(archive name, bytes, mode)] of the wheel, RECORD last."""
    dist_info = f"{NAME}-{version}.dist-info"
    files = []
    for name in package_sources(pkg_dir):
        with open(os.path.join(pkg_dir, name), "rb") as f:
            data = f.read()
        if name == "__init__.py":
            data = set_version(data.decode("utf-8"), version).encode("utf-8")
        files.append((f"{NAME}/{name}", data, 0o644))
    files.append((f"{NAME}/{LIB_NAME}", lib_bytes, 0o755))
    files.append((f"{dist_info}/METADATA", metadata(version).encode("utf-8"), 0o644))
    wheel = (f"Wheel-Version: 1.0\nGenerator: kvoffload scripts/build_wheel.py\n"
             f"Root-Is-Purelib: false\nTag: py3-none-{tag}\n")
    files.append((f"{dist_info}/WHEEL", wheel.encode("ascii"), 0o644))
    files.append((f"{dist_info}/top_level.txt", f"{NAME}\n".encode("ascii"), 0o644))
    record = io.StringIO()
    for name, data, _ in files:
        record.write(f"{name},{record_hash(data)},{len(data)}\n")
    record.write(f"{dist_info}/RECORD,,\n")
    files.append((f"{dist_info}/RECORD", record.getvalue().encode("utf-8"), 0o644))
    return files


def build(lib, out, root=ROOT, pkg_dir=None):
    """Writes the wheel into out (replacing one of the same version) and
    returns its path. The package's .py files come from pkg_dir (default:
    root's python/kvoffload)."""
    version = read_version(root)
    with open(lib, "rb") as f:
        lib_bytes = f.read()
    tag = platform_tag(lib_bytes)
    files = wheel_files(version, lib_bytes, tag, pkg_dir or os.path.join(root, "python", NAME))
    os.makedirs(out, exist_ok=True)
    for old in os.listdir(out):
        if old.startswith(f"{NAME}-{version}-") and old.endswith(".whl"):
            os.remove(os.path.join(out, old))
    path = os.path.join(out, f"{NAME}-{version}-py3-none-{tag}.whl")
    # Reproducible: fixed times (SOURCE_DATE_EPOCH when set), sorted by the caller.
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))  # 1980-01-01, zip's first date
    date = max(epoch, 315532800)
    when = time.gmtime(date)[:6]
    tmp = path + ".tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, mode in files:
            zi = zipfile.ZipInfo(name, date_time=when)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = (0o100000 | mode) << 16
            z.writestr(zi, data)
    os.replace(tmp, path)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="the libkvoffload.so to ship (built with -buildmode=c-shared)")
    ap.add_argument("--out", default=os.path.join(ROOT, "dist"), help="output folder (default: dist/)")
    ap.add_argument("--tag-only", action="store_true", help="print the library's platform tag and exit")
    args = ap.parse_args(argv)
    try:
        if args.tag_only:
            with open(args.lib, "rb") as f:
                print(platform_tag(f.read()))
            return 0
        path = build(args.lib, args.out)
    except (OSError, ValueError) as e:
        print(f"build_wheel: {e}", file=sys.stderr)
        return 1
    print(f"built {os.path.relpath(path)} ({os.path.getsize(path) >> 20} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
