package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

// createConfig is the JSON kvo_engine_create accepts: offload.Config plus
// the host backend's simulated GPU options.
type createConfig struct {
	offload.Config
	Sim *simConfig `json:"sim,omitempty"`
	// EarlyEvents is the key of the mode ABI 3 retired: refused with a
	// message saying so, rather than as an unknown field.
	EarlyEvents *bool `json:"early_events,omitempty"`
}

// simConfig configures the simulated GPU of the host backend: the seed of
// its random copy delays and their bounds in nanoseconds.
type simConfig struct {
	Seed       int64 `json:"seed"`
	MinDelayNS int64 `json:"min_delay_ns"`
	MaxDelayNS int64 `json:"max_delay_ns"`
}

// parseConfig decodes one JSON object, refusing unknown fields and
// trailing data; errors wrap offload.ErrInvalidConfig.
func parseConfig(text string) (offload.Config, hostsim.Options, error) {
	dec := json.NewDecoder(bytes.NewReader([]byte(text)))
	dec.DisallowUnknownFields()
	var cc createConfig
	if err := dec.Decode(&cc); err != nil {
		return offload.Config{}, hostsim.Options{}, fmt.Errorf("%w: config JSON: %w", offload.ErrInvalidConfig, err)
	}
	if dec.More() {
		return offload.Config{}, hostsim.Options{}, fmt.Errorf("%w: config JSON: trailing data after the object", offload.ErrInvalidConfig)
	}
	if cc.EarlyEvents != nil {
		return offload.Config{}, hostsim.Options{}, fmt.Errorf("%w: config JSON: early_events was retired in ABI 3: kvo_store and kvo_load always return before their copies are enqueued, and kvo_op_event and kvo_op_layer_event wait until the event is recorded", offload.ErrInvalidConfig)
	}
	if i := strings.IndexByte(cc.Namespace, 0); i >= 0 {
		return offload.Config{}, hostsim.Options{}, fmt.Errorf("%w: namespace %q has a NUL byte at %d: kvo_clear takes the namespace as a NUL-terminated C string and could not name it", offload.ErrInvalidConfig, cc.Namespace, i)
	}
	var opts hostsim.Options
	if cc.Sim != nil {
		if cc.Sim.MinDelayNS < 0 || cc.Sim.MaxDelayNS < cc.Sim.MinDelayNS {
			return offload.Config{}, hostsim.Options{}, fmt.Errorf("%w: sim delays [%d, %d] ns are not 0 <= min <= max", offload.ErrInvalidConfig, cc.Sim.MinDelayNS, cc.Sim.MaxDelayNS)
		}
		opts = hostsim.Options{Seed: cc.Sim.Seed, MinDelay: time.Duration(cc.Sim.MinDelayNS), MaxDelay: time.Duration(cc.Sim.MaxDelayNS)}
	}
	return cc.Config, opts, nil
}
