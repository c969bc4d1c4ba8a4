# kvoffload — see README.md. Every target works on a fresh Go machine; the
# gpu-* targets only build here and are run on a GPU machine.
GO          ?= go
STATICCHECK ?= $(GO) run honnef.co/go/tools/cmd/staticcheck@v0.8.2
PKGS        := ./...
GPU_PKGS    := internal/cuda register transfer internal/cudacopy internal/benchgpu kvcache offload cmd/kvoffload internal/tier/record internal/tier/disk internal/tier/cluster
GPU_LDFLAGS := -s -w $(VERSION_LDFLAGS)
NVCC        ?= nvcc
FUZZTIME    ?= 10s
SOAK_DURATION ?= 5m
SOAK_BACKEND  ?= auto
PYTHON      ?= python3

# The release version, one source: internal/version/VERSION (embedded in Go
# by internal/version, written into the wheel's __version__, the tag
# v$(VERSION)). The commit goes into the binaries for `kvoffload version`
# when Go's own VCS stamp is off (-buildvcs=false).
VERSION     := $(shell cat internal/version/VERSION)
COMMIT      := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(shell git diff --quiet HEAD 2>/dev/null || echo -dirty)
VERSION_LDFLAGS := -X github.com/kvoffload/kvoffload/internal/version.commit=$(COMMIT)

.PHONY: all build test vet staticcheck race nocgo demo bench gpu-bins gpu-tools ptx fuzz soak python wheel wheel-test release-tag clean

all: build

build:
	$(GO) build $(PKGS)
	$(GO) build -ldflags='$(VERSION_LDFLAGS)' -o build/kvoffload ./cmd/kvoffload

vet:
	$(GO) vet $(PKGS)

staticcheck:
	$(STATICCHECK) $(PKGS)

race:
	$(GO) test -race -count=1 -timeout 15m $(PKGS)

# The module must build (host backend only) without cgo.
nocgo:
	CGO_ENABLED=0 $(GO) build $(PKGS)
	CGO_ENABLED=0 $(GO) vet $(PKGS)

test: vet staticcheck nocgo race wheel-test

demo:
	$(GO) run ./cmd/kvoffload demo

bench:
	$(GO) test -run '^$$' -bench . -benchtime 1x $(PKGS)

# Everything the GPU suites need (scripts/gpu/run.sh): stripped cgo test
# binaries, the CLI, the soak build (invariants on) and libkvoffload.so, with
# the commit they were built from, packed into GPU_ARCHIVE for the device
# tool's carry (64 MiB a call, the working tree included).
GPU_ARCHIVE  := build/gpu.tar.gz
GPU_MAX_MIB  ?= 60
gpu-bins:
	rm -rf build/gpu $(GPU_ARCHIVE)
	mkdir -p build/gpu
	CGO_ENABLED=1 $(GO) build -ldflags='$(GPU_LDFLAGS)' -o build/gpu/kvoffload ./cmd/kvoffload
	CGO_ENABLED=1 $(GO) build -tags kvoinvariants -ldflags='$(GPU_LDFLAGS)' -o build/gpu/kvoffload-soak ./cmd/kvoffload
	for p in $(GPU_PKGS); do \
		CGO_ENABLED=1 $(GO) test -c -tags kvocompare -ldflags='$(GPU_LDFLAGS)' -o build/gpu/$$(echo $$p | tr / _).test ./$$p || exit 1; \
	done
	CGO_ENABLED=1 $(GO) build -tags kvocompare -buildmode=c-shared -ldflags='$(GPU_LDFLAGS)' -o build/gpu/libkvoffload.so ./capi
	rm -f build/gpu/libkvoffload.h
	{ git rev-parse HEAD 2>/dev/null || echo unknown; } | tr -d '\n' > build/gpu/COMMIT
	git diff --quiet HEAD 2>/dev/null || printf -- '-dirty' >> build/gpu/COMMIT
	echo >> build/gpu/COMMIT
	tar -czf $(GPU_ARCHIVE) -C build gpu
	@size=$$(stat -c %s $(GPU_ARCHIVE)); \
	echo "$(GPU_ARCHIVE): $$((size / 1048576)) MiB ($$size bytes), commit $$(cat build/gpu/COMMIT)"; \
	if [ $$size -gt $$(($(GPU_MAX_MIB) * 1048576)) ]; then \
		echo "$(GPU_ARCHIVE) is over $(GPU_MAX_MIB) MiB: the device tool carries 64 MiB a call, the working tree included" >&2; exit 1; \
	fi

# The programs the disk and cluster suites run on the GPU machine, which has
# no package manager: Debian's redis-server, redis-cli, redis-benchmark and
# fio (built from Debian's source package without its optional engines),
# with every library they need but glibc, packed as build/gpu-tools.tar.gz
# (under 12 MiB) to be carried beside build/gpu.tar.gz; run.sh puts them on
# PATH. Needs apt-get (Debian) and a C compiler; as root it also runs each
# program in a chroot holding glibc alone.
gpu-tools:
	bash scripts/gpu/tools.sh

# Regenerates the copy kernel's PTX; needs nvcc (run on the GPU machine).
# PTX ISA 7.0 is the lowest that targets sm_80 (checked with ptxas on the H200
# machine: 6.x refuses sm_80), so drivers back to CUDA 11.0 load it.
ptx:
	$(NVCC) -ptx -arch=compute_80 -O3 -o internal/cudacopy/kernels.ptx internal/cudacopy/kernels.cu
	sed -i 's/^\.version .*/.version 7.0/' internal/cudacopy/kernels.ptx

# Every fuzz target for FUZZTIME each (seed corpora: f.Add in the tests and
# testdata/fuzz/ in each package).
fuzz:
	FUZZTIME=$(FUZZTIME) bash scripts/fuzz.sh

# The demo's workload for SOAK_DURATION with random Trim, Delete, Clear and
# engine Close/reopen, built with the invariants on (copy gating with
# poisoned releases, and the block index checked after every change).
soak:
	$(GO) build -tags kvoinvariants -o build/kvoffload-soak ./cmd/kvoffload
	build/kvoffload-soak soak --duration $(SOAK_DURATION) --backend $(SOAK_BACKEND)

# libkvoffload.so (C ABI) into build/ and into the Python package.
python:
	bash capi/build.sh

# The wheel: dist/kvoffload-$(VERSION)-py3-none-manylinux_<glibc>_<arch>.whl,
# the pure-Python package and libkvoffload.so (scripts/build_wheel.py, the
# standard library only). The platform tag is the newest GLIBC_ symbol
# version the library needs; objdump, when there, must agree.
wheel:
	rm -rf build/wheel
	mkdir -p build/wheel dist
	CGO_ENABLED=1 $(GO) build -buildmode=c-shared -ldflags='-s -w $(VERSION_LDFLAGS)' -o build/wheel/libkvoffload.so ./capi
	rm -f build/wheel/libkvoffload.h
	@if command -v objdump >/dev/null 2>&1; then \
		want=$$(objdump -T build/wheel/libkvoffload.so | grep -o 'GLIBC_[0-9.]*' | sed 's/^GLIBC_//' | sort -uV | tail -1 | awk -F. '{print $$1 "_" $$2}'); \
		got=$$($(PYTHON) scripts/build_wheel.py --tag-only --lib build/wheel/libkvoffload.so); \
		echo "objdump -T: newest GLIBC_ $$want; platform tag $$got"; \
		case $$got in manylinux_$${want}_*) ;; *) echo "the platform tag disagrees with objdump" >&2; exit 1 ;; esac; \
	fi
	$(PYTHON) scripts/build_wheel.py --lib build/wheel/libkvoffload.so --out dist

# The wheel installed into a fresh venv (pip --no-index) and the Python
# tests run against the installed copy, outside the source tree.
wheel-test: wheel
	PYTHON=$(PYTHON) bash scripts/wheel_test.sh

# Tags the current commit v$(VERSION), the module's release tag (refused
# when the tag exists: bump internal/version/VERSION first).
release-tag:
	@if git rev-parse -q --verify "refs/tags/v$(VERSION)" >/dev/null; then \
		echo "tag v$(VERSION) exists: bump internal/version/VERSION" >&2; exit 1; fi
	git tag -a "v$(VERSION)" -m "kvoffload $(VERSION)"

clean:
	rm -rf build dist
