package nodepool_test

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvoffload/kvoffload/internal/nodepool"
	"github.com/kvoffload/kvoffload/kvcache"
)

// A node and one client: the client stores two blocks into slots it
// mapped from the node's regions, commits them, and finds them again with
// leases. A GPU engine would register each region in RegionAdded and copy
// with its own streams to and from Slot.Addr.
func Example() {
	dir, _ := os.MkdirTemp("", "nodepool-example")
	defer os.RemoveAll(dir)
	srv, err := nodepool.NewServer(nodepool.ServerConfig{Socket: filepath.Join(dir, "node.sock"), PoolBytes: 4 << 20, PrefaultThreads: 1})
	if err != nil {
		fmt.Println(err)
		return
	}
	go func() { _ = srv.Serve() }()
	defer srv.Close()

	layout := nodepool.LayoutOf(kvcache.CrossLayer, kvcache.Geometry{Layers: 2, KVHeads: 2, HeadDim: 64, DTypeBytes: 2, TokensPerBlock: 16})
	c, err := nodepool.Dial(srv.Addr(), nodepool.ClientConfig{Namespace: "tiny", Layout: layout, PrefaultThreads: 1,
		Hooks: nodepool.Hooks{
			RegionAdded:    func(r *nodepool.Region) error { return nil }, // cuMemHostRegister(r.Base, r.Size) here
			RegionRetiring: func(r *nodepool.Region) {},                   // wait for copies on r, then unregister
		}})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer c.Close()

	keys := []kvcache.Key{{1}, {2}}
	res, _ := c.BeginStore(nodepool.StoreRequest{Keys: keys}, nil)
	var slots []nodepool.Slot
	for i, r := range res {
		if r.Outcome == nodepool.StoreWrite {
			copy(c.SlotBytes(r.Slot), fmt.Sprintf("block %d", i)) // the D2H copy
			slots = append(slots, r.Slot)
		}
	}
	_ = c.CommitStore(slots) // once the copies' events retired

	hits, leased, _ := c.Lookup(keys, true, nil)
	fmt.Println(hits, string(c.SlotBytes(leased[1])[:7]))
	_ = c.Unlease(leased) // or after the H2D copies from them retired
	// Output: 2 block 1
}
