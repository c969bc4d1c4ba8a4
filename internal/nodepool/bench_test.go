package nodepool

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvoffload/kvoffload/kvcache"
)

// benchNode starts a node for a benchmark: in this process, or (child) in
// a child process as `kvoffload serve` would run, so that client and node
// are two processes sharing the machine's CPUs.
func benchNode(b *testing.B, child bool, pool int64) string {
	b.Helper()
	if !child {
		return startServer(b, ServerConfig{PoolBytes: pool, RegionBytes: pool}).Addr()
	}
	sock := filepath.Join(b.TempDir(), "node.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "NODEPOOL_CHILD=serve", "NODEPOOL_SOCKET="+sock, fmt.Sprintf("NODEPOOL_ARGS=%d", pool))
	stdin, _ := cmd.StdinPipe()
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = stdin.Close(); _ = cmd.Wait() })
	buf := make([]byte, 256)
	n, _ := out.Read(buf)
	if !strings.HasPrefix(string(buf[:n]), "listening") {
		b.Fatalf("node: %q", buf[:n])
	}
	return sock
}

// BenchmarkLookupLease: one Lookup of 1024 keys with leases (all hits),
// one round trip; the Unlease that gives them back is outside the timer.
// Target: ≤ 100 µs per round trip.
func BenchmarkLookupLease(b *testing.B) {
	for _, child := range []bool{false, true} {
		b.Run(fmt.Sprintf("node=%s", map[bool]string{false: "inproc", true: "process"}[child]), func(b *testing.B) {
			sock := benchNode(b, child, 64<<20)
			c := dial(b, sock, ClientConfig{NoPrefault: true})
			defer c.Close()
			c.WaitRegions(10 * time.Second)
			keys := testKeys(1, 1024)
			res, err := c.BeginStore(StoreRequest{Keys: keys}, nil)
			if err != nil {
				b.Fatal(err)
			}
			var slots []Slot
			for _, r := range res {
				slots = append(slots, r.Slot)
			}
			if err := c.CommitStore(slots); err != nil {
				b.Fatal(err)
			}
			var leased []Slot
			// The lookups alone are timed, by hand: StopTimer and
			// StartTimer around each Unlease would stop the world twice an
			// iteration (ReadMemStats) and park the node's goroutines.
			var looked time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				var hits int
				t0 := time.Now()
				hits, leased, err = c.Lookup(keys, true, leased[:0])
				looked += time.Since(t0)
				if err != nil || hits != 1024 {
					b.Fatalf("%d hits, %v", hits, err)
				}
				if err := c.Unlease(leased); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(looked.Nanoseconds())/1e3/float64(b.N), "µs/roundtrip")
		})
	}
}

// BenchmarkStoreCommit: BeginStore of 1024 new keys (one chain) and their
// CommitStore, two round trips, on a full pool (every store evicts).
// Target: ≤ 1 µs per block.
func BenchmarkStoreCommit(b *testing.B) {
	for _, child := range []bool{false, true} {
		b.Run(fmt.Sprintf("node=%s", map[bool]string{false: "inproc", true: "process"}[child]), func(b *testing.B) {
			sock := benchNode(b, child, 64<<20) // 4096 slots
			c := dial(b, sock, ClientConfig{NoPrefault: true})
			defer c.Close()
			c.WaitRegions(10 * time.Second)
			var res []StoreResult
			slots := make([]Slot, 0, 1024)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				keys := testKeys(i+7, 1024)
				var err error
				res, err = c.BeginStore(StoreRequest{Keys: keys}, res[:0])
				if err != nil {
					b.Fatal(err)
				}
				slots = slots[:0]
				for _, r := range res {
					if r.Outcome == StoreWrite {
						slots = append(slots, r.Slot)
					}
				}
				if len(slots) != 1024 {
					b.Fatalf("%d of 1024 reserved", len(slots))
				}
				if err := c.CommitStore(slots); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1024, "ns/block")
		})
	}
}

// BenchmarkRoundTrip: the floor of one op, a Lookup of one key without a
// lease (the transport and the two wake-ups, nearly no index work).
func BenchmarkRoundTrip(b *testing.B) {
	for _, child := range []bool{false, true} {
		b.Run(fmt.Sprintf("node=%s", map[bool]string{false: "inproc", true: "process"}[child]), func(b *testing.B) {
			sock := benchNode(b, child, 16<<20)
			c := dial(b, sock, ClientConfig{NoPrefault: true})
			defer c.Close()
			keys := testKeys(1, 1)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, _, err := c.Lookup(keys, false, nil); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkIndexLookupLease: the index's share of BenchmarkLookupLease,
// kvcache.LookupLease of the same 1024 keys in this process, no node.
func BenchmarkIndexLookupLease(b *testing.B) {
	g := kvcache.Geometry{Layers: int(testLayout.Layers), KVHeads: int(testLayout.KVHeads), HeadDim: int(testLayout.HeadDim),
		DTypeBytes: int(testLayout.DTypeBytes), TokensPerBlock: int(testLayout.TokensPerBlock)}
	l, err := kvcache.NewLayout(kvcache.DenseRankSpec(kvcache.CrossLayer, g, kvcache.OrderUndeclared, kvcache.HeadRange{}, 4096, 1<<44))
	if err != nil {
		b.Fatal(err)
	}
	c, err := kvcache.New(kvcache.Config{Layout: l})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	if _, err := c.AddRegion(kvcache.Region{ID: 1, Base: 1 << 40, Size: 64 << 20}); err != nil {
		b.Fatal(err)
	}
	keys := testKeys(1, 1024)
	res, _ := c.BeginStore(kvcache.StoreRequest{Keys: keys, BlockIDs: blockIDs[:1024]}, nil)
	var sl []kvcache.Slot
	for _, r := range res {
		sl = append(sl, r.Slot)
	}
	if err := c.CompleteStore(sl, nil); err != nil {
		b.Fatal(err)
	}
	var dst []kvcache.Slot
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		_, dst = c.LookupLease(keys, dst[:0])
		b.StopTimer()
		if err := c.Unlease(dst); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
	}
}
