#!/bin/sh
# Builds libkvoffload.so (the C ABI, header capi/kvoffload.h) into build/ and
# copies it next to the Python package. Run from anywhere; needs cgo (gcc).
#   capi/build.sh            # build/libkvoffload.so + python/kvoffload/libkvoffload.so
#   GO=/path/to/go capi/build.sh
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
GO=${GO:-go}
mkdir -p build
CGO_ENABLED=1 "$GO" build -buildmode=c-shared -ldflags='-s -w' -o build/libkvoffload.so ./capi
rm -f build/libkvoffload.h # cgo's generated header; the public one is capi/kvoffload.h
cp capi/kvoffload.h build/kvoffload.h
cp build/libkvoffload.so python/kvoffload/libkvoffload.so
echo "built build/libkvoffload.so and python/kvoffload/libkvoffload.so"
