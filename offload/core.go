package offload

import (
	"context"
	"errors"
	"sync"
)

// errNotWired is returned until the engine core lands on kvcache and transfer.
var errNotWired = errors.New("offload: engine core not wired yet")

type engineHooks struct{}

// SimGPU is the simulated GPU of the host backend.
type SimGPU struct{}

func newEngine(cfg Config, _ engineHooks) (*Engine, error) {
	e := &Engine{cfg: cfg}
	e.growCond = sync.NewCond(&e.growMu)
	return nil, errNotWired
}

func (e *Engine) lookup([]Key, LookupOptions) (LookupResult, error) {
	return LookupResult{}, errNotWired
}
func (e *Engine) store(context.Context, []Key, []int, StoreOptions) (*Op, error) {
	return nil, errNotWired
}
func (e *Engine) load(context.Context, []Key, []int, LoadOptions) (*Op, error) {
	return nil, errNotWired
}
func (e *Engine) delete([]Key) int                                { return 0 }
func (e *Engine) clear(string) int                                { return 0 }
func (e *Engine) unlease([]Key)                                   {}
func (e *Engine) snapshot() Stats                                 { return Stats{} }
func (e *Engine) trim(context.Context, int64) (TrimResult, error) { return TrimResult{}, errNotWired }
func (e *Engine) staging(string, int64) (*Staging, error)         { return nil, errNotWired }
func (e *Engine) waitGrown(context.Context) error                 { return errNotWired }
func (e *Engine) shutdown() error                                 { return errNotWired }
