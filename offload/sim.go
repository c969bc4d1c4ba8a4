package offload

import (
	"github.com/kvoffload/kvoffload/internal/cudadev"
	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/offload/internal/simhook"
)

// The hooks of package hostsim (see offload/internal/simhook).
func init() {
	simhook.NewEngine = func(cfg any, sim *cudadev.Sim, diskFaults func(disk.FaultOp, string) error) (any, error) {
		return newEngine(cfg.(Config), engineHooks{sim: sim, diskFaults: diskFaults})
	}
	simhook.Sim = func(eng any) *cudadev.Sim { return eng.(*Engine).sim }
	simhook.Violations = func(eng any) []error { return eng.(*Engine).invariantViolations() }
}

// invariantViolations returns the gating violations recorded so far: a copy
// whose host range was not live, or was released and reused while it ran.
// Only builds with invariants on (-race, or -tags kvoinvariants) check
// them; other builds return nil. Any violation is a bug in the engine.
func (e *Engine) invariantViolations() []error {
	if e.tracker == nil {
		return nil
	}
	return e.tracker.Violations()
}
