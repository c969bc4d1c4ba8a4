package offload

import (
	"time"

	"github.com/kvoffload/kvoffload/transfer"
)

// SimOptions configure a SimGPU.
type SimOptions struct {
	// Seed seeds the random copy delays, so a failing run can be replayed.
	Seed int64
	// MinDelay and MaxDelay bound the random delay before each copy runs.
	MinDelay, MaxDelay time.Duration
}

// SimGPU is the simulated GPU of the host backend: "device memory" is
// ordinary memory at made-up addresses, copies run on goroutines after a
// random delay, and completions arrive out of order across directions, as
// on a GPU. Tests and demos allocate a KV cache in it and read and write it.
type SimGPU struct{ sim *transfer.Sim }

// NewSimGPU starts a simulated GPU. Close it after the engines using it.
func NewSimGPU(opts SimOptions) (*SimGPU, error) {
	s, err := transfer.NewSim(transfer.SimConfig{Seed: opts.Seed, MinDelay: opts.MinDelay, MaxDelay: opts.MaxDelay})
	if err != nil {
		return nil, err
	}
	return &SimGPU{sim: s}, nil
}

// Alloc allocates n bytes of simulated device memory.
func (g *SimGPU) Alloc(n uint64) (uint64, error) { return g.sim.MemAlloc(n) }

// Free frees an Alloc allocation.
func (g *SimGPU) Free(addr uint64) error { return g.sim.MemFree(addr) }

// Write copies p to simulated device memory at addr.
func (g *SimGPU) Write(addr uint64, p []byte) error { return g.sim.Write(addr, p) }

// Read copies simulated device memory at addr into p.
func (g *SimGPU) Read(addr uint64, p []byte) error { return g.sim.Read(addr, p) }

// Close stops the simulation.
func (g *SimGPU) Close() error { return g.sim.Close() }

// Sim returns the simulated GPU of the host backend (Config.Sim, or the one
// the engine made), in which a layout given without tensors was allocated;
// nil on the CUDA backend.
func (e *Engine) Sim() *SimGPU { return e.sim }
