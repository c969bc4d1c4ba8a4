// Package hostsim is the host backend's simulated device: the CUDA code
// path over the module's fake driver (cudadev.Sim), "GPU memory" in
// anonymous host mappings, copies run by the fake's stream goroutines after
// a random, seeded delay, completions out of order across directions as on
// a GPU. It is for tests, demos and the C ABI's kvo_sim_* calls, not for a
// serving stack's main path, which imports only package offload.
//
// An engine on the host backend (offload.Config.Backend "host", or "auto"
// without a driver) always runs over a simulated device: NewEngine gives
// it one the caller made (so that the caller allocates, writes and reads
// the KV cache in it, and can read it after Close); offload.New makes its
// own, which GPUOf returns. Both go through offload.Config's seam
// (HostDevice, DiskFaults).
package hostsim

import (
	"time"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/offload"
)

// DiskFaultOp is the kind of disk tier file operation Options.DiskFaults
// is asked about: "open" (the records file, for writing), "open-direct"
// (with O_DIRECT), "write", "read" or "fallocate" (preallocating it).
type DiskFaultOp string

// Options configure a GPU.
type Options struct {
	// Seed seeds the random copy delays, so a failing run can be replayed.
	Seed int64
	// MinDelay and MaxDelay bound the random delay before each copy runs.
	MinDelay, MaxDelay time.Duration
	// DiskFaults, when set, runs before each file operation op of the disk
	// tier on directory dir of the engines NewEngine makes on this GPU; a
	// non-nil error replaces the operation's result (unix.ENOSPC for
	// "write", unix.EIO for "read", unix.EROFS for "open": the directory
	// is opened read-only): the simulated machine's disk
	// failing, for tests and demos. Leave it nil otherwise.
	DiskFaults func(op DiskFaultOp, dir string) error
}

// GPU is a simulated GPU. Tests and demos allocate a KV cache in it and
// read and write it.
type GPU struct {
	sim        *cudadev.Sim
	diskFaults func(op DiskFaultOp, dir string) error
}

// NewGPU starts a simulated GPU. Close it after the engines using it.
func NewGPU(opts Options) (*GPU, error) {
	s, err := cudadev.NewSim(cudadev.SimConfig{Seed: opts.Seed, MinDelay: opts.MinDelay, MaxDelay: opts.MaxDelay})
	if err != nil {
		return nil, err
	}
	return &GPU{sim: s, diskFaults: opts.DiskFaults}, nil
}

// Alloc allocates n bytes of simulated device memory.
func (g *GPU) Alloc(n uint64) (uint64, error) { return g.sim.MemAlloc(n) }

// Free frees an Alloc allocation.
func (g *GPU) Free(addr uint64) error { return g.sim.MemFree(addr) }

// Write copies p to simulated device memory at addr.
func (g *GPU) Write(addr uint64, p []byte) error { return g.sim.Write(addr, p) }

// Read copies simulated device memory at addr into p.
func (g *GPU) Read(addr uint64, p []byte) error { return g.sim.Read(addr, p) }

// Close stops the simulation.
func (g *GPU) Close() error { return g.sim.Close() }

// seam sets cfg's hostsim seam to gpu.
func (g *GPU) seam(cfg offload.Config) offload.Config {
	cfg.HostDevice = g.sim
	if f := g.diskFaults; f != nil {
		cfg.DiskFaults = func(op, dir string) error { return f(DiskFaultOp(op), dir) }
	}
	return cfg
}

// NewEngine is offload.New with gpu as the device of the host backend,
// when that backend is selected (Backend "host", or "auto" without a
// driver, where a Layout giving addresses is then taken as addresses in
// gpu); on the CUDA backend gpu is unused. The engine does not close gpu.
func NewEngine(cfg offload.Config, gpu *GPU) (*offload.Engine, error) {
	return offload.New(gpu.seam(cfg))
}

// Dial is offload.Dial with gpu as the device of the host backend, when
// that backend is selected (as NewEngine). A Config without layout
// tensors and a Backend other than "host" makes a client without a GPU
// (see offload.Dial): gpu is unused then. The engine does not close gpu.
func Dial(socket string, cfg offload.Config, gpu *GPU) (*offload.Engine, error) {
	return offload.Dial(socket, gpu.seam(cfg))
}

// GPUOf returns the simulated GPU of an engine on the host backend (the
// one given to NewEngine, or the one offload.New made, in which a layout
// given without tensors was allocated); nil on the CUDA backend. The
// engine closes a GPU it made itself: do not Close that one.
func GPUOf(e *offload.Engine) *GPU {
	s, ok := e.Config().HostDevice.(*cudadev.Sim)
	if !ok {
		return nil
	}
	return &GPU{sim: s}
}

// InvariantViolations returns the gating violations e recorded so far
// (e.InvariantViolations).
func InvariantViolations(e *offload.Engine) []error { return e.InvariantViolations() }
