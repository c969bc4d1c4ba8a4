package offload_test

import (
	"bytes"
	"context"
	"fmt"
	"log"

	"github.com/kvoffload/kvoffload/offload"
)

// The serving loop on the host backend: store two blocks the GPU computed,
// look their keys up with a lease, and load them into other GPU blocks.
// On the CUDA backend the code is the same, with the layout giving the
// device addresses of the stack's KV cache and the ops' events ordering
// the copies with the stack's stream.
func Example() {
	eng, err := offload.New(offload.Config{
		PoolBytes: 1 << 20, // exactly 1 MiB of host pool
		Backend:   offload.BackendHost,
		Policy:    offload.PolicyLRU,
		Layout: offload.LayoutSpec{Kind: offload.LayoutCrossLayer, Layers: 2, KVHeads: 1, HeadDim: 64,
			DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: 8},
	})
	if err != nil {
		log.Fatal(err)
	}
	defer eng.Close()
	ctx := context.Background()

	// The layout was given without tensors, so the engine placed the KV
	// cache in its simulated GPU: block b is at Base + b*Stride.
	l := eng.Config().Layout
	block := func(id int) uint64 { return l.Base + uint64(id)*l.Stride }
	gpu := eng.Sim()
	_ = gpu.Write(block(0), bytes.Repeat([]byte("a"), int(l.Stride)))
	_ = gpu.Write(block(1), bytes.Repeat([]byte("b"), int(l.Stride)))

	// Keys chain over the tokens: 32 tokens are two full blocks.
	tokens := make([]uint32, 32)
	for i := range tokens {
		tokens[i] = uint32(1000 + i)
	}
	keys := eng.Keys(tokens)

	op, err := eng.Store(ctx, keys, []int{0, 1}, offload.StoreOptions{})
	if err != nil {
		log.Fatal(err)
	}
	_ = op.Wait(ctx)
	out, _ := op.Outcomes()
	fmt.Println("store:", out)
	_ = op.Release()

	res, _ := eng.Lookup(keys, offload.LookupOptions{Lease: true})
	fmt.Println("hits:", res.Hits)

	op, err = eng.Load(ctx, keys[:res.Hits], []int{5, 6}, offload.LoadOptions{Lease: res.Lease})
	if err != nil {
		log.Fatal(err)
	}
	_ = op.Wait(ctx)
	out, _ = op.Outcomes()
	fmt.Println("load:", out)
	_ = op.Release()

	got := make([]byte, 4)
	_ = gpu.Read(block(6), got)
	fmt.Printf("block 6 now starts with %q\n", got)
	// Output:
	// store: [stored stored]
	// hits: 2
	// load: [loaded loaded]
	// block 6 now starts with "bbbb"
}
