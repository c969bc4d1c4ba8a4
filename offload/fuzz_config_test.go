package offload

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// The child is a small program of its own (internal/configchild), built
// once per test run with CGO_ENABLED=0: no cgo threads, no race detector
// shadow memory, no coverage counters. It limits its address space
// (RLIMIT_AS) to what the Go runtime mapped at start plus 1 GiB before
// calling New, so that an allocation proportional to a bad size fails the
// child ("fatal error: out of memory", a non-zero exit) and the target,
// while the runtime's own reservations (several hundred MiB of address
// space, mostly never touched) do not eat the budget.

// configChild builds internal/configchild once and returns its path.
var configChild = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "kvo-configchild")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "configchild")
	cmd := exec.Command("go", "build", "-o", bin, "./internal/configchild")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building internal/configchild: %w\n%s", err, out)
	}
	return bin, nil
})

// FuzzNewConfig feeds New extreme sizes (math.MaxInt64, negative, 2^62 …)
// on the host backend, with and without the memory check: New must
// return an engine or an error, never panic, abort or allocate memory
// proportional to a size that does not fit (the child's 1 GiB address
// space).
func FuzzNewConfig(f *testing.F) {
	f.Add(int64(1)<<62, int64(0), int64(0), int64(0), int64(0), 2, 1, 64, 2, 16, 8, uint8(0), false, "")
	f.Add(int64(1)<<62, int64(0), int64(0), int64(0), int64(0), 2, 1, 64, 2, 16, 8, uint8(0), true, "")
	f.Add(int64(math.MaxInt64), int64(0), int64(1)<<62, int64(0), int64(0), 2, 1, 64, 2, 16, 8, uint8(0), false, "")
	f.Add(int64(1)<<60, int64(0), int64(0), int64(0), int64(0), 2, 1, 64, 2, 16, 8, uint8(1), false, "")
	f.Add(int64(1)<<58, int64(0), int64(0), int64(0), int64(0), 2, 1, 64, 2, 16, 8, uint8(2), true, "")
	f.Add(int64(1)<<48, int64(1)<<48, int64(1)<<40, int64(-1), int64(0), 2, 64, 64, 2, 16, 2, uint8(0), true, "")
	f.Add(int64(64)<<20, int64(0), int64(0), int64(-1), int64(0), 1, 1, 1, 1, 1, 2, uint8(0), false, "")
	f.Add(int64(1)<<20, int64(-5), int64(0), int64(math.MaxInt64), int64(0), 1<<17, 1, 64, 2, 16, 8, uint8(0), true, "")
	f.Add(int64(1)<<20, int64(0), int64(0), int64(0), int64(-1), 2, 2, 576, 2, 16, math.MaxInt, uint8(2), true, "99")
	f.Add(int64(1)<<20, int64(0), int64(0), int64(0), int64(0), 2, 1<<30, 1<<30, 1<<30, 1, 1, uint8(0), false, "abc")
	f.Fuzz(func(t *testing.T, pool, first, region, staging, maxCached int64, layers, heads, headDim, dtype, tokens, blocks int, kind uint8, skip bool, numa string) {
		cfg := Config{PoolBytes: pool, FirstRegionBytes: first, RegionBytes: region, StagingBytes: staging, MaxCachedBytes: maxCached,
			Backend: BackendHost, SkipMemoryCheck: skip, NUMANode: numa, HugePages: HugePagesNone, PrefaultThreads: 1,
			Layout: LayoutSpec{Kind: []LayoutKind{LayoutLayerSeparate, LayoutCrossLayer, LayoutMLA}[kind%3], Layers: layers, KVHeads: heads,
				HeadDim: headDim, DTypeBytes: dtype, TokensPerBlock: tokens, NumBlocks: blocks}}
		if kind%2 == 1 {
			cfg.Policy = PolicyTinyLFU
		}
		in, err := json.Marshal(cfg)
		if err != nil {
			t.Fatal(err)
		}
		runConfigChild(t, in)
	})
}

// runConfigChild runs the config in through configchild under the
// address-space limit and fails t unless New returned (an engine or an
// error) without a panic or an abort.
func runConfigChild(t *testing.T, in []byte) {
	t.Helper()
	bin, err := configChild()
	if err != nil {
		t.Fatal(err)
	}
	// New on a config that fits prefaults its first region at most (1 GiB
	// under the limit): seconds. A child still running after a minute is
	// a hang, and fails the target like a crash.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Stdin = bytes.NewReader(in)
	cmd.Env = append(os.Environ(), "GOTRACEBACK=single")
	start := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("New(%s) in a child limited to 1 GiB of address space: %v after %v\n%s", in, err, time.Since(start), out)
	}
}
