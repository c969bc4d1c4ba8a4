package offload_test

import (
	"bytes"
	"context"
	"fmt"
	"log"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
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
	// cache in its simulated GPU (package hostsim): block b is at Base + b*Stride.
	l := eng.Config().Layout
	block := func(id int) uint64 { return l.Base + uint64(id)*l.Stride }
	gpu := hostsim.GPUOf(eng)
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

// sequence is what the README's serving step knows of a request.
type sequence struct{ Tokens []uint32 }

// newEngine is the README's engine creation, verbatim between the markers.
func newEngine(poolBytes int64, numGPUBlocks int, layerTensors []offload.LayerTensors, serve func(*offload.Engine) error) error {
	// README: begin New
	eng, err := offload.New(offload.Config{
		PoolBytes: poolBytes, // e.g. 100 << 30: exactly 100 GiB of pinned host memory, no power-of-two rounding
		Device:    0,
		Namespace: "llama-3-8b/bf16", // mixed into every key: two models never share blocks
		Layout: offload.LayoutSpec{
			Kind: offload.LayoutLayerSeparate, Layers: 32, KVHeads: 8, HeadDim: 128,
			DTypeBytes: 2, TokensPerBlock: 16, NumBlocks: numGPUBlocks,
			LayerTensors: layerTensors, // device addresses of each layer's K and V cache, and the block stride
		},
	})
	if err != nil {
		return err
	}
	defer eng.Close()
	// README: end New
	return serve(eng)
}

// servingStep is the README's scheduling step, verbatim between the
// markers: it returns how many leading blocks to recompute.
func servingStep(ctx context.Context, eng *offload.Engine, seq sequence, gpuBlocks []int, computeStream uintptr,
	newKeys []offload.Key, newBlocks []int, writtenEvent uintptr, parentKey offload.Key) (recompute int, err error) {
	// README: begin step
	keys := eng.Keys(seq.Tokens) // one 128-bit key per full block, chained

	// 1. Admission: how much of the prefix is offloaded? Lease it so it cannot be evicted.
	res, err := eng.Lookup(keys, offload.LookupOptions{Lease: true})
	if err != nil {
		return 0, err
	}

	// 2. Bring it back into freshly allocated GPU blocks; attention waits on the op's event.
	if res.Hits > 0 {
		op, err := eng.Load(ctx, keys[:res.Hits], gpuBlocks[:res.Hits], offload.LoadOptions{
			Lease: res.Lease, PerLayer: true, // one event per layer: layer 0 can start early
		})
		if err != nil {
			// ErrBusy (or the engine closed): recompute instead. The lease is still ours.
			_ = res.Lease.Release()
			recompute = res.Hits
		} else {
			_ = op.StreamWait(computeStream) // or wait on op.LayerEvent(l) per layer
			_ = op.Release()                 // returns at once: the stream's wait holds
		}
	}

	// 3. After prefill/decode, offload the new full blocks. After is an event recorded on
	//    the compute stream after the kernels that wrote them (never inside a graph capture);
	//    Parent chains them to the sequence's blocks stored by earlier steps.
	op, err := eng.Store(ctx, newKeys, newBlocks, offload.StoreOptions{After: writtenEvent, Parent: parentKey})
	if err != nil {
		return 0, err
	}
	_ = op.StreamWait(computeStream) // before the stack reuses those GPU blocks
	_ = op.Release()
	// README: end step
	return recompute, nil
}

// The README's code, run: an engine made as the README makes it (the
// layout given without tensors, so the host backend simulates the GPU),
// then three scheduling steps of one sequence growing by a block each,
// stored over several calls as one chain.
func Example_readme() {
	err := newEngine(8<<20, 64, nil, func(eng *offload.Engine) error {
		ctx := context.Background()
		tokens := make([]uint32, 16*4)
		for i := range tokens {
			tokens[i] = uint32(i)
		}
		all := eng.Keys(tokens)
		// Step 1 computes blocks 0-1; steps 2 and 3 each add one block.
		for step, n := range []int{2, 3, 4} {
			prev := n - 1
			if step == 0 {
				prev = 0
			}
			var parent offload.Key
			if prev > 0 {
				parent = all[prev-1]
			}
			seq := sequence{Tokens: tokens[:16*n]}
			gpu := []int{10, 11, 12, 13}
			recompute, err := servingStep(ctx, eng, seq, gpu, 0, all[prev:n], gpu[prev:n], 0, parent)
			if err != nil {
				return err
			}
			res, _ := eng.Lookup(all[:n], offload.LookupOptions{})
			fmt.Printf("step %d: recompute %d, %d blocks offloaded\n", step+1, recompute, res.Hits)
		}
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
	// Output:
	// step 1: recompute 0, 2 blocks offloaded
	// step 2: recompute 0, 3 blocks offloaded
	// step 3: recompute 0, 4 blocks offloaded
}
