package offload

import (
	"context"
	"fmt"
)

// New validates cfg, picks the backend, checks that the machine can hold
// the pool, maps and pins the staging region and the first pool region, and
// returns once the first slots are usable. The rest of the pool is mapped,
// prefaulted and pinned in the background, region by region in a pipeline
// (region i+1 prefaulted while region i registers and region i-1 joins the
// cache); see PauseGrowth, WaitGrown, Stats.FullPool and Stats.Growth. On
// error nothing is left mapped, pinned or running.
func New(cfg Config) (*Engine, error) {
	return newEngine(cfg, engineHooks{})
}

// Stats returns a snapshot of the engine's counters; cheap, callable from
// any goroutine, also after Close.
func (e *Engine) Stats() Stats { return e.snapshot() }

// Trim gives pinned pool memory back to the OS in whole regions, newest
// first, until at least bytes are picked (or every pool region is): it
// evicts the regions' ready blocks, waits (honouring ctx) for the copies in
// flight on them, then unpins and unmaps them. It never waits for leases: a
// region holding leased blocks is reported in TrimResult.PendingBytes and
// released by the engine when its last lease ends; when ctx ends first, what
// is not freed yet is reported pending too, and is freed later all the same.
// bytes ≤ 0 trims nothing. Staging buffers are never trimmed. Trimmed
// memory stays released: background growth, if still running, stops at
// what is left after the trim (regions already being grown included), and
// the pool grows again only when GrowTo asks for it.
func (e *Engine) Trim(ctx context.Context, bytes int64) (TrimResult, error) {
	if !e.enter() {
		return TrimResult{}, fmt.Errorf("%w: Trim after Close", ErrClosed)
	}
	defer e.leave()
	return e.trim(ctx, bytes)
}

// Staging returns the staging buffer called name, of exactly bytes bytes,
// at an address fixed until Close. Asking again for the same name and size
// returns the same buffer; a different size is an error. When the reserved
// staging region (Config.StagingBytes) has no room left it returns
// ErrInsufficientMemory.
func (e *Engine) Staging(name string, bytes int64) (*Staging, error) {
	if err := e.checkOpen("Staging"); err != nil {
		return nil, err
	}
	return e.staging(name, bytes)
}

// PauseGrowth stops background pinning after the region in progress (for a
// caller that wants no pinning during its own graph capture; the engine's
// relaxed capture mode makes that unnecessary). Idempotent. The region
// being registered finishes and joins the pool. The region being
// prefetched (mapped and prefaulted ahead of registration) finishes its
// prefault and is held, mapped but not pinned, not counted in
// Stats.OwnedBytes or Stats.Regions, until ResumeGrowth registers it or
// Close unmaps it. No further region is mapped meanwhile.
// If the copy methods are not calibrated yet, the growth thread calibrates
// them during the pause.
func (e *Engine) PauseGrowth() {
	e.growMu.Lock()
	e.paused = true
	e.growMu.Unlock()
}

// ResumeGrowth lets background pinning continue. Idempotent.
func (e *Engine) ResumeGrowth() {
	e.growMu.Lock()
	e.paused = false
	e.growCond.Broadcast()
	e.growMu.Unlock()
}

// GrowTo sets the pool size that background growth aims at to bytes
// (capped at Config.PoolBytes and Config.MaxCachedBytes) and, when growth
// has ended below it, starts growing again in the background: the way to
// have memory back after Trim, or after growth stopped on an error
// (Stats.GrowthError, which GrowTo clears). A lower size stops growth
// there; it never trims (Trim does). WaitGrown waits for the new growth.
func (e *Engine) GrowTo(bytes int64) error {
	if !e.enter() {
		return fmt.Errorf("%w: GrowTo after Close", ErrClosed)
	}
	defer e.leave()
	if bytes < 0 {
		return fmt.Errorf("%w: GrowTo(%d): must not be negative", ErrInvalidArgument, bytes)
	}
	limit := e.cfg.PoolBytes
	if e.cfg.MaxCachedBytes > 0 {
		limit = min(limit, e.cfg.MaxCachedBytes)
	}
	e.growMu.Lock()
	defer e.growMu.Unlock()
	e.target = min(bytes, limit)
	if !e.growDone || e.stopGrow || e.committed+e.slot > e.target {
		return nil
	}
	// Growth has ended: plan regions for the rest and start it again.
	e.growErr = nil
	e.growFrom = len(e.plan)
	e.plan = append(e.plan, regionPlan(e.target-e.committed, e.cfg.RegionBytes, e.cfg.RegionBytes, e.slot)...)
	e.growDone = false
	e.stats.fullPool.Store(0)
	e.wg.Add(1)
	go e.grow()
	return nil
}

// WaitGrown blocks until background growth has ended: the whole pool
// pinned, or growth stopped on an error (returned), and then, on CUDA, the
// copy methods calibrated (Stats.CopyCalibration); or until the engine is
// closed (ErrClosed), or ctx ends.
func (e *Engine) WaitGrown(ctx context.Context) error {
	return e.waitGrown(ctx)
}

// Close refuses new calls (ErrClosed), cancels queued work, waits for the
// copies in flight, ends leases, then unpins and unmaps every region,
// staging included. A second Close returns ErrClosed. Ops and leases stay
// readable after Close (Wait, Outcomes); their events are gone. Close waits
// as long as a copy is in flight; CloseContext bounds the wait.
func (e *Engine) Close() error { return e.CloseContext(context.Background()) }

// CloseContext is Close with a bound on the wait for copies in flight (a
// device whose events never complete). When ctx ends first it returns an
// error wrapping ctx's: the engine is closed to new calls, but memory a
// copy may still write is never unmapped under it, so the release of the
// regions, streams and context is left to a background goroutine that
// finishes as soon as the last copy completes or fails (or never, if the
// device never reports it: the pool then stays mapped until the process
// exits).
func (e *Engine) CloseContext(ctx context.Context) error {
	if e.closed.Swap(true) {
		return fmt.Errorf("%w: Close called twice", ErrClosed)
	}
	done := make(chan error, 1)
	go func() { done <- e.shutdown() }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		return fmt.Errorf("offload: Close gave up waiting for copies in flight (%d bytes); the engine is closed and releases its memory when they end: %w",
			e.stats.inFlightBytes.Load(), ctx.Err())
	}
}
