// Package cudahook lets the module's own packages reach the driver handles
// inside package transfer's Driver and Context, whose exported API names no
// internal type: register pins in a transfer.Context's context, and tests
// wrap a fake driver (internal/cuda/cudafake) as a transfer.Driver.
// Package transfer sets the functions in its init.
package cudahook

import "github.com/kvoffload/kvoffload/internal/cuda"

var (
	// WrapDriver returns drv as a *transfer.Driver.
	WrapDriver func(drv cuda.Driver) any
	// ContextOf returns the driver and primary context of a
	// *transfer.Context (ok false for anything else, or a nil one).
	ContextOf func(c any) (drv cuda.Driver, ctx cuda.Context, ok bool)
)
