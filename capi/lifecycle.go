//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

// An engine handle's life: kvo_engine_create, kvo_engine_connect and
// kvo_engine_destroy.

//export kvoGo_engine_create
func kvoGo_engine_create(configJSON *C.char, out *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if configJSON == nil || out == nil {
		return failf("kvo_engine_create: config_json and out must not be NULL")
	}
	return openEngine(configJSON, out, hostsim.NewEngine)
}

//export kvoGo_engine_connect
func kvoGo_engine_connect(socket, configJSON *C.char, out *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if socket == nil || configJSON == nil || out == nil {
		return failf("kvo_engine_connect: socket, config_json and out must not be NULL")
	}
	sock := C.GoString(socket)
	return openEngine(configJSON, out, func(cfg offload.Config, sim *hostsim.GPU) (*offload.Engine, error) {
		return hostsim.Dial(sock, cfg, sim)
	})
}

// openEngine parses configJSON, makes the host backend's simulated device
// and opens an engine on it with open (its own pool, or a node's), storing
// the new handle in *out.
func openEngine(configJSON *C.char, out *C.uint64_t, open func(offload.Config, *hostsim.GPU) (*offload.Engine, error)) C.int {
	h, err := createEngine(C.GoString(configJSON), open)
	if err != nil {
		return fail(err)
	}
	*out = C.uint64_t(h)
	return codeOK
}

// createEngine is openEngine's work: the engine and its simulated GPU,
// published under a new handle only once both are made.
func createEngine(configJSON string, open func(offload.Config, *hostsim.GPU) (*offload.Engine, error)) (uint64, error) {
	cfg, opts, err := parseConfig(configJSON)
	if err != nil {
		return 0, err
	}
	sim, err := hostsim.NewGPU(opts)
	if err != nil {
		return 0, fmt.Errorf("%w: sim: %w", offload.ErrInvalidConfig, err)
	}
	eng, err := open(cfg, sim)
	if err != nil {
		sim.Close()
		return 0, err
	}
	return engines.add(&engineEntry{eng: eng, sim: sim}), nil
}

//export kvoGo_engine_destroy
func kvoGo_engine_destroy(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if err := destroyEngine(uint64(h)); err != nil {
		return fail(err)
	}
	return codeOK
}

// destroyEngine takes handle h (of concurrent destroys exactly one does;
// the others, and every later call, are KVO_ECLOSED) and runs every step
// of the destroy whatever the one before did: the engine closed, its event
// stream dropped, its simulated GPU closed. A step that fails, or panics
// (recovered here, step by step), is reported once all have run, so a
// destroyed handle never leaves an engine or a simulated GPU behind.
func destroyEngine(h uint64) error {
	e, err := engines.take(h)
	if err != nil {
		if errors.Is(err, errStale) {
			return fmt.Errorf("%w (%w): %w", offload.ErrClosed, errEngineStale, err)
		}
		return err
	}
	var errs []error
	step := func(name string, f func() error) {
		defer func() {
			if r := recover(); r != nil {
				errs = append(errs, fmt.Errorf("kvoffload: destroy: %s: internal error (panic): %v", name, r))
			}
		}()
		err := f()
		if destroyStepHook != nil {
			destroyStepHook(name)
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	step("closing the engine", e.eng.Close)
	step("dropping the event stream", func() error { dropEvents(h); return nil })
	step("closing the simulated GPU", func() error {
		if err := e.sim.Close(); err != nil {
			return fmt.Errorf("kvoffload: closing the simulated GPU: %w", err)
		}
		return nil
	})
	return errors.Join(errs...)
}

// destroyStepHook, when set (by tests only), runs at the end of each step
// of destroyEngine with the step's name: a panic there stands for a step
// that fails.
var destroyStepHook func(step string)
