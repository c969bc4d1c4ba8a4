package nodepool

import (
	"context"
	"sync"
	"testing"

	"github.com/kvoffload/kvoffload/internal/tiered"
)

// TestNodeDiskWriteBackOnClose: a node whose pool holds 5 blocks stored
// once (none evicted: nothing written back), one of them leased by a
// client still connected, and a slot reserved (its bytes filled) but never
// committed, closes; a new node on the same directory finds on disk:
//   - with WriteBackOnClose, the 5 blocks (DiskWrittenAtClose 5, none
//     left), loaded byte-exact by a client, and not the reserved one;
//   - without it, none;
//   - with it and a context already ended at Close, none: nothing is
//     written and the 5 are counted left (DiskLeftAtClose);
//   - with it and a context that ends during the first write (the
//     writers' hook cancels it), those written (at most one a writer) and
//     no others, written and left adding up to 5.
func TestNodeDiskWriteBackOnClose(t *testing.T) {
	for _, tc := range []struct {
		name    string
		onClose bool
		ctx     func() (context.Context, func(Key)) // Close's context and the writers' hook
		written int                                 // -1: at least 1, the rest left
		left    int
	}{
		{name: "on", onClose: true, written: 5},
		{name: "off", onClose: false, written: 0},
		{name: "spent", onClose: true, written: 0, left: 5, ctx: func() (context.Context, func(Key)) {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx, nil
		}},
		{name: "ends during", onClose: true, written: -1, ctx: func() (context.Context, func(Key)) {
			ctx, cancel := context.WithCancel(context.Background())
			var once sync.Once
			return ctx, func(Key) { once.Do(cancel) }
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ctx := context.Background()
			var hook func(Key)
			if tc.ctx != nil {
				ctx, hook = tc.ctx()
			}
			s, c := diskNode(t, tiered.DiskConfig{Dirs: []string{dir}, WriteBackOnClose: tc.onClose}, 0, hook)
			keys := spreadKeys(26, 6)
			stored, reserved := keys[:5], keys[5]
			for _, k := range stored {
				storeOneBlock(t, c, k, Key{})
			}
			// A lease the client keeps across the node's Close: a ready
			// block, complete, written all the same.
			if hits, _, err := c.Lookup(stored[:1], true, nil); err != nil || hits != 1 {
				t.Fatalf("lookup: %d hits, %v", hits, err)
			}
			// A reservation never committed: its slot is not a block.
			res, err := c.BeginStore(StoreRequest{Keys: []Key{reserved}}, nil)
			if err != nil || res[0].Outcome != StoreWrite {
				t.Fatalf("reserve: %+v, %v", res, err)
			}
			fill(c.SlotBytes(res[0].Slot), reserved)
			if st := s.Stats(); st.Cache.Evicted != 0 || st.DiskWrites != 0 || st.DiskRecords != 0 {
				t.Fatalf("before Close: %+v", st)
			}

			if err := s.CloseContext(ctx); err != nil {
				t.Fatal(err)
			}
			st := s.Stats()
			written := int(st.DiskWrittenAtClose)
			if tc.written >= 0 {
				if written != tc.written || int(st.DiskLeftAtClose) != tc.left {
					t.Fatalf("at close: %d written, %d left; want %d, %d", written, st.DiskLeftAtClose, tc.written, tc.left)
				}
			} else if written < 1 || written > tiered.Writers || written+int(st.DiskLeftAtClose) != len(stored) {
				// One write a writer at most: the rest are not started.
				t.Fatalf("ended during: %d written, %d left; want 1 to %d, adding up to %d", written, st.DiskLeftAtClose, tiered.Writers, len(stored))
			}
			if st.DiskWrites != 0 || st.DiskWriteErrors != 0 || int(st.DiskRecords) != written {
				t.Fatalf("after close: %+v", st)
			}

			s2 := startServer(t, ServerConfig{ClientShare: 1, PoolBytes: 8 * testSlot, RegionBytes: 8 * testSlot, Disk: &tiered.DiskConfig{Dirs: []string{dir}, CapacityBytes: 8 << 20}})
			c2 := dial(t, s2.Addr(), ClientConfig{})
			defer c2.Close()
			if n := onDisk(t, c2, stored); n != written {
				t.Fatalf("a restarted node finds %d of the %d blocks on disk; %d were written", n, len(stored), written)
			}
			if n := onDisk(t, c2, []Key{reserved}); n != 0 {
				t.Fatal("the block reserved and never committed is on disk")
			}
			if written == len(stored) {
				loadChecked(t, c2, stored)
				if st := s2.Stats(); st.DiskHits != int64(len(stored)) || st.DiskMisses != 0 {
					t.Fatalf("promotions after the restart: %+v", st)
				}
			}
		})
	}
}
