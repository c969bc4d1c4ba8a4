#!/usr/bin/env bash
# Installs the kvoffload wheel into a fresh virtual environment and runs the
# Python package's tests (python/tests) against the installed copy, outside
# the source tree: the tests are copied to a temporary folder laid out like
# the repository (python/tests, with capi/, kvcache/, bench/, internal/ and
# scripts/ linked in for the files they read), PYTHONPATH and KVOFFLOAD_LIB are
# unset, so `import kvoffload` finds the venv's package and the package its
# library beside it. Needs no network (pip install --no-index), nor Go, but
# for the node of tests/test_connect.py (see KVOFFLOAD_BIN below).
#
#   bash scripts/wheel_test.sh [--system-site-packages] [WHEEL]
#
# WHEEL defaults to the one dist/ holds for internal/version/VERSION.
# --system-site-packages lets the venv see the system's packages and those of
# the interpreter that made it (torch on the GPU machine: scripts/gpu/run.sh
# wheel, with KVO_REQUIRE_GPU=1).
# PYTHON picks the interpreter (default python3).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
venv_flags=()
if [ "${1:-}" = --system-site-packages ]; then
	venv_flags+=(--system-site-packages)
	shift
fi
version=$(cat "$root/internal/version/VERSION")
wheel=${1:-}
if [ -z "$wheel" ]; then
	shopt -s nullglob
	wheels=("$root"/dist/kvoffload-"$version"-*.whl)
	[ ${#wheels[@]} -eq 1 ] || { echo "wheel_test: want one dist/kvoffload-$version-*.whl (make wheel), found ${#wheels[@]}" >&2; exit 2; }
	wheel=${wheels[0]}
fi
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
echo "wheel_test: $wheel"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
venv=$tmp/venv
start=$(date +%s)
# A Python without ensurepip (Debian without python3-venv) can still make a
# venv without pip; the interpreter's own pip then installs into it.
if "$py" -m venv "${venv_flags[@]}" "$venv" 2>"$tmp/venv.err"; then
	pip=("$venv/bin/python" -m pip)
else
	cat "$tmp/venv.err" >&2
	echo "wheel_test: python3 -m venv failed; trying --without-pip and $py -m pip --python" >&2
	rm -rf "$venv"
	"$py" -m venv --without-pip "${venv_flags[@]}" "$venv"
	pip=("$py" -m pip --python "$venv/bin/python")
fi
"${pip[@]}" install --no-index --no-deps --disable-pip-version-check --no-cache-dir -q "$wheel"
if [ ${#venv_flags[@]} -gt 0 ]; then
	# --system-site-packages shows the base interpreter's packages only: when
	# $py is itself a venv (the GPU machine's python3 is /opt/torch/.venv),
	# its packages (torch) come in through a .pth file, after the new venv's own.
	parent=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
	[ "$parent" = "$site" ] || echo "$parent" >"$site/_kvo_parent_site.pth"
fi

# tests/test_connect.py runs a node (`kvoffload serve`): KVOFFLOAD_BIN, or
# the CLI built here when go is at hand (the test skips without either).
if [ -z "${KVOFFLOAD_BIN:-}" ] && command -v go >/dev/null 2>&1; then
	if (cd "$root" && go build -o "$tmp/kvoffload" ./cmd/kvoffload); then
		export KVOFFLOAD_BIN=$tmp/kvoffload
	fi
fi

mkdir -p "$tmp/src/python"
cp -r "$root/python/tests" "$tmp/src/python/tests"
find "$tmp/src/python/tests" -name __pycache__ -prune -exec rm -rf {} +
for d in capi kvcache bench internal scripts; do ln -s "$root/$d" "$tmp/src/$d"; done

cd "$tmp/src/python"
unset PYTHONPATH KVOFFLOAD_LIB
export PYTHONDONTWRITEBYTECODE=1
"$venv/bin/python" - "$venv" "$version" "$(basename "$wheel")" <<'PY'
import os, sys
venv, version, wheel = sys.argv[1:]
import kvoffload
from kvoffload import _lib
pkg = os.path.dirname(os.path.realpath(kvoffload.__file__))
assert pkg.startswith(os.path.realpath(venv) + os.sep), f"imported {pkg}, not the venv's copy"
assert os.path.dirname(os.path.realpath(_lib.library_path())) == pkg, _lib.library_path()
assert os.path.exists(_lib.library_path()), "no libkvoffload.so beside the installed package"
assert kvoffload.__version__ == version, (kvoffload.__version__, version)
assert wheel.startswith(f"kvoffload-{version}-py3-none-manylinux_"), wheel
assert kvoffload.library_version() == version, (kvoffload.library_version(), version)
print(f"wheel_test: kvoffload {kvoffload.__version__} from {pkg}, library {kvoffload.library_version()}, ABI {kvoffload.abi_version()}")
PY
"$venv/bin/python" -m unittest discover -s tests -t . -v
echo "wheel_test: ok in $(($(date +%s) - start)) s"
