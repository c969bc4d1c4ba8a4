#!/usr/bin/env bash
# shellcheck disable=SC1091 # /etc/os-release is the build machine's
# Builds build/gpu-tools.tar.gz (make gpu-tools): the programs the disk and
# cluster suites need on the GPU machine, which has no package manager and
# no network: Debian's redis-server, redis-cli and redis-benchmark
# (apt-get download, dpkg -x) and fio built here from Debian's source
# package of the same version (apt-get source), configured without the
# optional engines (ceph, gluster, rdma, nbd, pmem, numa, http) whose
# libraries the Debian binary needs at start (about 60 of them, far above
# the size the device tool carries), with libaio linked in statically.
#
# Layout of the archive (unpacked into build/ by scripts/gpu/run.sh):
#   gpu-tools/bin/NAME      a wrapper: LD_LIBRARY_PATH=../lib, exec ../libexec/NAME
#   gpu-tools/libexec/NAME  the program
#   gpu-tools/lib/          every shared library the programs need (ldd here)
#                           except glibc's own, so that nothing but glibc
#                           (>= Debian 12's 2.36) is taken from the machine
#   gpu-tools/VERSIONS      the packages and what was built how
# Only the wrappers see the carried libraries: nothing else (python, torch)
# runs with them.
#
#   bash scripts/gpu/tools.sh [--no-check]   as root it also runs every program
#                                            in a chroot holding glibc alone
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
WORK=$ROOT/build/gpu-tools-work
OUTDIR=$ROOT/build/gpu-tools
ARCHIVE=$ROOT/build/gpu-tools.tar.gz
MAX_MIB=${GPU_TOOLS_MAX_MIB:-12}
FIO_VERSION=3.33-3
REDIS_PKGS=(redis-server redis-tools)
PROGRAMS=(redis-server redis-cli redis-benchmark fio)
# glibc's libraries: the machine's own are used (Ubuntu 24.04: 2.39).
GLIBC_RE='^(linux-vdso|ld-linux|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl)\.so'

check=0
[ "$(id -u)" = 0 ] && check=1
[ "${1:-}" = --no-check ] && check=0

rm -rf "$WORK" "$OUTDIR" "$ARCHIVE"
mkdir -p "$WORK"/{debs,src,x,aio,apt/lists/partial} "$OUTDIR"/{bin,libexec,lib}

# Debian's binary packages (the machine's configured sources).
(cd "$WORK/debs" && apt-get download "${REDIS_PKGS[@]}" libaio-dev)
for d in "$WORK"/debs/redis-*.deb; do dpkg -x "$d" "$WORK/x"; done
dpkg -x "$WORK"/debs/libaio-dev_*.deb "$WORK/aio"
rm -f "$WORK"/aio/usr/lib/x86_64-linux-gnu/libaio.so # link libaio.a in

# fio's source package: a private apt state (deb-src of the same suite), so
# that the machine's apt configuration is left as it is.
suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
echo "deb-src http://deb.debian.org/debian $suite main" >"$WORK/apt/src.list"
apto=(-o "Dir::Etc::SourceList=$WORK/apt/src.list" -o Dir::Etc::SourceParts=/dev/null
	-o "Dir::State::Lists=$WORK/apt/lists")
apt-get "${apto[@]}" update >/dev/null
(cd "$WORK/src" && apt-get "${apto[@]}" source --download-only "fio=$FIO_VERSION" >/dev/null)
tar -xzf "$WORK"/src/fio_*.orig.tar.gz -C "$WORK/src"
fiosrc=$(echo "$WORK"/src/fio-*/)
aioinc=$WORK/aio/usr/include aiolib=$WORK/aio/usr/lib/x86_64-linux-gnu
(cd "$fiosrc" && ./configure --extra-cflags="-I$aioinc -L$aiolib" --disable-native --disable-numa --disable-rdma \
	--disable-rados --disable-rbd --disable-http --disable-gfapi --disable-pmem --disable-tcmalloc \
	--disable-xnvme --disable-libzbc --disable-dfs >"$WORK/fio-configure.log" 2>&1 &&
	make -j"$(nproc)" fio LDFLAGS="-L$aiolib" >"$WORK/fio-make.log" 2>&1) ||
	{ tail -20 "$WORK"/fio-*.log >&2; exit 1; }
grep -q '^Linux AIO support *yes' "$WORK/fio-configure.log" || { echo "fio: configure found no libaio" >&2; exit 1; }

install -m 0755 "$fiosrc/fio" "$OUTDIR/libexec/fio"
for p in redis-server redis-cli redis-benchmark; do
	# redis-server is a link to redis-check-rdb: the copy keeps the name
	# redis-server (the program picks its role from argv[0]).
	install -m 0755 "$(readlink -f "$WORK/x/usr/bin/$p")" "$OUTDIR/libexec/$p"
done
strip "$OUTDIR"/libexec/*

# Every library the programs load, except glibc's, as ldd resolves it here.
for p in "${PROGRAMS[@]}"; do
	ldd "$OUTDIR/libexec/$p" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
		if [ -z "$path" ] || [ "$path" = "not" ]; then
			echo "$p: $name not found here" >&2
			exit 1
		fi
		[[ $name =~ $GLIBC_RE ]] && continue
		[ -f "$OUTDIR/lib/$name" ] || install -m 0644 "$(readlink -f "$path")" "$OUTDIR/lib/$name"
	done
done
strip --strip-unneeded "$OUTDIR"/lib/*.so*

for p in "${PROGRAMS[@]}"; do
	cat >"$OUTDIR/bin/$p" <<EOF
#!/bin/sh
# $p from build/gpu-tools (scripts/gpu/tools.sh): its libraries from ../lib.
here=\${0%/*}
LD_LIBRARY_PATH="\$here/../lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
exec "\$here/../libexec/$p" "\$@"
EOF
	chmod 0755 "$OUTDIR/bin/$p"
done

{
	echo "build/gpu-tools: made by scripts/gpu/tools.sh on $(. /etc/os-release && echo "$PRETTY_NAME"), $(date -u +%F)"
	for d in "$WORK"/debs/*.deb; do dpkg-deb -f "$d" Package Version | paste -sd' ' | sed 's/^/deb: /'; done
	echo "fio: built from Debian's source package fio $FIO_VERSION: ./configure --disable-native (and the optional engines off), libaio $(dpkg-deb -f "$WORK"/debs/libaio-dev_*.deb Version) linked statically"
	echo "engines: $("$OUTDIR/bin/fio" --enghelp | tail -n +2 | xargs | tr ' ' ,)"
	echo "lib:" "$(cd "$OUTDIR/lib" && echo *)"
	echo "glibc from the machine: at least $(ldd --version | head -1 | awk '{print $NF}') (built here)"
} >"$OUTDIR/VERSIONS"

# Every program runs with glibc and the carried libraries alone.
if [ "$check" = 1 ]; then
	croot=$WORK/chroot
	mkdir -p "$croot"/{lib64,lib/x86_64-linux-gnu,bin,tmp}
	cp -L /lib64/ld-linux-x86-64.so.2 "$croot/lib64/"
	for l in /lib/x86_64-linux-gnu/*.so*; do
		[[ $(basename "$l") =~ $GLIBC_RE ]] && cp -L "$l" "$croot/lib/x86_64-linux-gnu/"
	done
	cp -L /bin/dash "$croot/bin/sh"
	cp -a "$OUTDIR" "$croot/gpu-tools"
	for p in "${PROGRAMS[@]}"; do
		out=$(chroot "$croot" /gpu-tools/bin/"$p" --version 2>&1) || { echo "chroot: $p: $out" >&2; exit 1; }
		echo "chroot (glibc alone): $p: $(echo "$out" | head -1)"
	done
else
	echo "not checked in a chroot (needs root)"
fi

tar -czf "$ARCHIVE" -C "$ROOT/build" gpu-tools
size=$(stat -c %s "$ARCHIVE")
libs=("$OUTDIR"/lib/*)
echo "$ARCHIVE: $((size / 1048576)) MiB ($size bytes): $(cd "$OUTDIR/libexec" && echo *), ${#libs[@]} libraries"
if [ "$size" -gt $((MAX_MIB * 1048576)) ]; then
	echo "$ARCHIVE is over $MAX_MIB MiB (it travels beside build/gpu.tar.gz, 64 MiB a call in all)" >&2
	exit 1
fi
