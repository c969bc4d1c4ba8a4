// Package simhook is how package hostsim reaches what package offload
// keeps unexported for it: an engine built over a given simulated device,
// the engine's simulated device, and its gating-invariant violations.
// Package offload sets the functions in its init; only hostsim calls them.
// The engine and config travel as any because offload imports this
// package (hostsim asserts them back to *offload.Engine).
package simhook

import (
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
)

var (
	// NewEngine builds an engine from cfg (an offload.Config) whose host
	// backend, if selected, uses sim as its device; diskFaults, when not
	// nil, is tier/disk's Config.Faults for the engine's disk tier.
	NewEngine func(cfg any, sim *cudadev.Sim, diskFaults func(op disk.FaultOp, dir string) error) (eng any, err error)
	// Dial is offload.Dial(socket, cfg) with sim as the device of the
	// host backend, if selected.
	Dial func(socket string, cfg any, sim *cudadev.Sim) (eng any, err error)
	// Sim returns an *offload.Engine's simulated device (nil on CUDA).
	Sim func(eng any) *cudadev.Sim
	// Violations returns an *offload.Engine's gating violations.
	Violations func(eng any) []error
)
