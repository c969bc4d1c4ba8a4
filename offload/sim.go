package offload

import (
	"fmt"

	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
)

// withSeam takes the host device and disk faults of cfg (package
// hostsim's seam) into h, where the tests' hooks have not set them.
func (h engineHooks) withSeam(cfg Config) (engineHooks, error) {
	if h.sim == nil && cfg.HostDevice != nil {
		sim, ok := cfg.HostDevice.(*cudadev.Sim)
		if !ok {
			return h, fmt.Errorf("%w: HostDevice is a %T, not a hostsim GPU's device", ErrInvalidConfig, cfg.HostDevice)
		}
		h.sim = sim
	}
	if h.diskFaults == nil && cfg.DiskFaults != nil {
		faults := cfg.DiskFaults
		h.diskFaults = func(op disk.FaultOp, dir string) error { return faults(faultOpName(op), dir) }
	}
	return h, nil
}

// faultOpName is Config.DiskFaults's name of an internal/tier/disk fault op.
func faultOpName(op disk.FaultOp) string {
	switch op {
	case disk.FaultOpen:
		return "open"
	case disk.FaultOpenDirect:
		return "open-direct"
	case disk.FaultWrite:
		return "write"
	case disk.FaultRead:
		return "read"
	case disk.FaultFallocate:
		return "fallocate"
	}
	return fmt.Sprintf("op(%d)", uint8(op))
}

// InvariantViolations returns the copy-gating bugs caught in -race builds.
func (e *Engine) InvariantViolations() []error {
	if e.tracker == nil {
		return nil
	}
	return e.tracker.Violations()
}
