package cudacopy

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvoffload/kvoffload/internal/cuda"
)

// The device memory budget (Options.MaxDeviceBytes). Descriptor tables and
// staging chunks are separate allocations, pooled for reuse; devBytes
// counts every one allocated and never exceeds the bound. A call short of
// memory first frees idle pooled allocations it does not need, then waits
// for the oldest outstanding ticket's done event and reclaims its memory.

// DeviceBytes is the device memory the Copier has allocated now
// (descriptor tables, staging chunks, Calibrate's buffer while it runs);
// safe to call at any time, also after Close (0 then).
func (c *Copier) DeviceBytes() int64 { return c.devNow.Load() }

// PeakDeviceBytes is the most device memory the Copier has had allocated
// at once; never above MaxDeviceBytes.
func (c *Copier) PeakDeviceBytes() int64 { return c.devPeak.Load() }

// MaxDeviceBytes is the bound in force (Options.MaxDeviceBytes, default
// applied).
func (c *Copier) MaxDeviceBytes() int64 { return c.opts.MaxDeviceBytes }

// BudgetWaits is the number of times a call waited for an earlier batch's
// copies to complete because MaxDeviceBytes left too little free.
func (c *Copier) BudgetWaits() int64 { return c.budgetWaits.Load() }

// devAllocLocked allocates n bytes of device memory and counts them; the
// caller has checked the bound (and holds mu, or is New).
func (c *Copier) devAllocLocked(n uint64) (cuda.DevicePtr, error) {
	if c.devBytes+int64(n) > c.opts.MaxDeviceBytes {
		// Unreachable by construction; refuse rather than overrun.
		return 0, fmt.Errorf("%w: allocating %d bytes with %d of MaxDeviceBytes %d allocated", ErrDeviceBudget, n, c.devBytes, c.opts.MaxDeviceBytes)
	}
	p, err := c.drv.MemAlloc(n)
	if err != nil {
		return 0, err
	}
	c.devBytes += int64(n)
	c.devNow.Store(c.devBytes)
	if c.devBytes > c.devPeak.Load() {
		c.devPeak.Store(c.devBytes)
	}
	return p, nil
}

// devFreeLocked frees an allocation of n bytes made by devAllocLocked.
func (c *Copier) devFreeLocked(p cuda.DevicePtr, n uint64) error {
	err := c.drv.MemFree(p)
	c.devBytes -= int64(n)
	c.devNow.Store(c.devBytes)
	return err
}

// missingBytes is the device memory n (plus raw bytes) needs beyond the
// idle pooled tables and chunks.
func (c *Copier) missingBytes(n need, raw int64) int64 {
	return int64(max(0, n.bufs-len(c.free)))*c.descBytes() +
		int64(max(0, n.staging-len(c.stagingFree)))*int64(c.opts.GatherChunkBytes) + raw
}

// evictIdleLocked frees one idle pooled table or chunk that n does not
// need (chunks first when n needs tables, tables first otherwise); false
// when there is none.
func (c *Copier) evictIdleLocked(n need) (bool, error) {
	chunkFirst := n.bufs > len(c.free)
	for range 2 {
		if chunkFirst && len(c.stagingFree) > n.staging {
			p := c.stagingFree[len(c.stagingFree)-1]
			c.stagingFree = c.stagingFree[:len(c.stagingFree)-1]
			c.stagingAll = slices.DeleteFunc(c.stagingAll, func(q cuda.DevicePtr) bool { return q == p })
			return true, c.devFreeLocked(p, uint64(c.opts.GatherChunkBytes))
		}
		if !chunkFirst && len(c.free) > n.bufs {
			b := c.free[len(c.free)-1]
			c.free = c.free[:len(c.free)-1]
			c.all = slices.DeleteFunc(c.all, func(q *descBuf) bool { return q == b })
			return true, errors.Join(c.devFreeLocked(b.dev, uint64(c.descBytes())), c.drv.MemFreeHost(b.host))
		}
		chunkFirst = !chunkFirst
	}
	return false, nil
}

// makeRoomLocked frees idle pooled memory n does not need until n's
// missing tables and chunks and raw bytes fit the bound; false when they
// cannot without waiting.
func (c *Copier) makeRoomLocked(n need, raw int64) (bool, error) {
	if c.tableCap > 0 {
		// KeepIdle: nothing is freed; tables and chunks each stay
		// within their share of the bound.
		tables := int64(len(c.all)+max(0, n.bufs-len(c.free))) * c.descBytes()
		chunks := int64(len(c.stagingAll)+max(0, n.staging-len(c.stagingFree)))*int64(c.opts.GatherChunkBytes) + raw
		return tables <= c.tableCap && chunks+c.devBytes-int64(len(c.all))*c.descBytes()-int64(len(c.stagingAll))*int64(c.opts.GatherChunkBytes) <= c.opts.MaxDeviceBytes-c.tableCap, nil
	}
	for c.devBytes+c.missingBytes(n, raw) > c.opts.MaxDeviceBytes {
		ok, err := c.evictIdleLocked(n)
		if err != nil || !ok {
			return false, err
		}
	}
	return true, nil
}

// waitOldestLocked waits (mu released meanwhile) for the done event of the
// oldest outstanding ticket that holds device memory and reclaims that
// memory; false when no ticket can be waited for.
func (c *Copier) waitOldestLocked() (bool, error) {
	oldest := -1
	for i := range c.recs {
		r := &c.recs[i]
		if r.live && r.done != 0 && (len(r.bufs) > 0 || len(r.staging) > 0) && (oldest < 0 || r.seq < c.recs[oldest].seq) {
			oldest = i
		}
	}
	if oldest < 0 {
		return false, nil
	}
	gen, ev := c.recs[oldest].gen, c.recs[oldest].done
	c.budgetWaits.Add(1)
	c.mu.Unlock()
	err := c.drv.EventSynchronize(ev)
	c.mu.Lock()
	if err != nil {
		return false, fmt.Errorf("cudacopy: waiting for a batch's copies to free device memory: %w", err)
	}
	if r := &c.recs[oldest]; r.live && r.gen == gen && r.done == ev {
		// Its copies have completed: its memory is free to reuse; Retire
		// will only end the record.
		c.free = append(c.free, r.bufs...)
		c.stagingFree = append(c.stagingFree, r.staging...)
		c.eventsFree = append(c.eventsFree, r.events...)
		clear(r.bufs)
		r.bufs, r.staging, r.events, r.done = r.bufs[:0], r.staging[:0], r.events[:0], 0
	}
	return true, nil
}

// budgetErr is the ErrDeviceBudget of a call needing want bytes in all.
func (c *Copier) budgetErr(what string, want int64) error {
	return fmt.Errorf("%w: %s needs %s of device memory; MaxDeviceBytes is %s, and %s of it is held by memory that no outstanding batch will give back",
		ErrDeviceBudget, what, FormatBytes(uint64(want)), FormatBytes(uint64(c.opts.MaxDeviceBytes)), FormatBytes(uint64(max(c.devBytes, 0))))
}

// acquire takes n's descriptor buffers, staging chunks and events and a
// ticket record, allocating what the pools lack within MaxDeviceBytes,
// waiting for outstanding tickets' memory where it must.
func (c *Copier) acquire(n need) (Ticket, grant, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	want := int64(n.bufs)*c.descBytes() + int64(n.staging)*int64(c.opts.GatherChunkBytes)
	if want > c.opts.MaxDeviceBytes {
		return Ticket{}, grant{}, fmt.Errorf("%w: a batch needs %s of device memory (%d descriptor tables of %s, %d staging chunks of %s), over MaxDeviceBytes %s",
			ErrDeviceBudget, FormatBytes(uint64(want)), n.bufs, FormatBytes(uint64(c.descBytes())), n.staging, FormatBytes(uint64(c.opts.GatherChunkBytes)), FormatBytes(uint64(c.opts.MaxDeviceBytes)))
	}
	for {
		if c.closed {
			return Ticket{}, grant{}, ErrClosed
		}
		ok, err := c.makeRoomLocked(n, 0)
		if err != nil {
			return Ticket{}, grant{}, err
		}
		if ok {
			break
		}
		waited, err := c.waitOldestLocked()
		if err != nil {
			return Ticket{}, grant{}, err
		}
		if !waited {
			if !c.submittingLocked() {
				return Ticket{}, grant{}, c.budgetErr("a batch", want)
			}
			// Another thread is enqueueing a ticket: once enqueued it can
			// be waited for.
			c.cond.Wait()
		}
	}
	for len(c.free) < n.bufs {
		b, err := c.newDescBuf()
		if err != nil {
			return Ticket{}, grant{}, err
		}
		c.free = append(c.free, b)
	}
	for len(c.stagingFree) < n.staging {
		p, err := c.devAllocLocked(uint64(c.opts.GatherChunkBytes))
		if err != nil {
			return Ticket{}, grant{}, fmt.Errorf("cudacopy: staging chunk of %d bytes (%d in use): %w", c.opts.GatherChunkBytes, len(c.stagingAll)-len(c.stagingFree), err)
		}
		c.stagingAll = append(c.stagingAll, p)
		c.stagingFree = append(c.stagingFree, p)
	}
	for len(c.eventsFree) < n.events {
		e, err := c.drv.EventCreate(cuda.EventDisableTiming)
		if err != nil {
			return Ticket{}, grant{}, fmt.Errorf("cudacopy: copy event: %w", err)
		}
		c.eventsAll = append(c.eventsAll, e)
		c.eventsFree = append(c.eventsFree, e)
	}
	var idx int32
	if k := len(c.freeRecs); k > 0 {
		idx = c.freeRecs[k-1]
		c.freeRecs = c.freeRecs[:k-1]
	} else {
		c.recs = append(c.recs, ticketRec{})
		idx = int32(len(c.recs) - 1)
	}
	r := &c.recs[idx]
	r.live = true
	c.seq++
	r.seq = c.seq
	r.bufs = append(r.bufs[:0], c.free[len(c.free)-n.bufs:]...)
	c.free = c.free[:len(c.free)-n.bufs]
	r.staging = append(r.staging[:0], c.stagingFree[len(c.stagingFree)-n.staging:]...)
	c.stagingFree = c.stagingFree[:len(c.stagingFree)-n.staging]
	r.events = append(r.events[:0], c.eventsFree[len(c.eventsFree)-n.events:]...)
	c.eventsFree = c.eventsFree[:len(c.eventsFree)-n.events]
	c.outstanding++
	// The record's own slices: nothing changes them until the ticket is
	// reclaimed (after setDone) or ended, by when the caller is done.
	g := grant{bufs: r.bufs, staging: r.staging, events: r.events}
	return Ticket{idx: idx + 1, gen: r.gen}, g, nil
}

// submittingLocked reports whether a ticket holding device memory is being
// enqueued (acquired, its done event not yet set).
func (c *Copier) submittingLocked() bool {
	for i := range c.recs {
		if r := &c.recs[i]; r.live && r.done == 0 && (len(r.bufs) > 0 || len(r.staging) > 0) {
			return true
		}
	}
	return false
}

// copyReserve is the device memory allocRaw leaves to copies: one staged
// copy's full ring of chunks and two descriptor tables (two tables without
// staged copies), so that a copy beside Calibrate never finds the budget
// held by something it cannot wait for.
func (c *Copier) copyReserve() int64 {
	r := 2 * c.descBytes()
	if !c.opts.NoGather {
		r += int64(c.opts.GatherRing) * int64(c.opts.GatherChunkBytes)
	}
	return r
}

// setDone makes ticket t's memory reclaimable once ev, recorded after all
// of t's work, has completed.
func (c *Copier) setDone(t Ticket, ev cuda.Event) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if r := &c.recs[t.idx-1]; r.live && r.gen == t.gen {
		r.done = ev
	}
	c.cond.Broadcast()
}

// allocRaw allocates n bytes of device memory for the caller's own use
// (Calibrate's buffer) within MaxDeviceBytes, as acquire does; free it
// with freeRaw.
func (c *Copier) allocRaw(n uint64, what string) (cuda.DevicePtr, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if int64(n)+c.copyReserve() > c.opts.MaxDeviceBytes {
		return 0, fmt.Errorf("%w: %s of %s and the %s one staged copy needs beside it are over MaxDeviceBytes %s",
			ErrDeviceBudget, what, FormatBytes(n), FormatBytes(uint64(c.copyReserve())), FormatBytes(uint64(c.opts.MaxDeviceBytes)))
	}
	for {
		if c.closed {
			return 0, ErrClosed
		}
		ok, err := c.makeRoomLocked(need{}, int64(n))
		if err != nil {
			return 0, err
		}
		if ok {
			p, err := c.devAllocLocked(n)
			if err != nil {
				return 0, fmt.Errorf("cudacopy: %s of %d bytes: %w", what, n, err)
			}
			return p, nil
		}
		waited, err := c.waitOldestLocked()
		if err != nil {
			return 0, err
		}
		if !waited {
			if !c.submittingLocked() {
				return 0, c.budgetErr(what, int64(n))
			}
			c.cond.Wait()
		}
	}
}

// freeRaw frees an allocRaw allocation of n bytes. cuMemFree may wait
// for the whole device to be idle, so it is called without mu: a
// submitting thread must never wait for it (see KeepIdle).
func (c *Copier) freeRaw(p cuda.DevicePtr, n uint64) error {
	err := c.drv.MemFree(p)
	c.mu.Lock()
	defer c.mu.Unlock()
	defer c.cond.Broadcast()
	c.devBytes -= int64(n)
	c.devNow.Store(c.devBytes)
	return err
}

// KeepIdle makes the copier never free device memory while it submits:
// the bound is split between descriptor tables (an eighth, at least two
// tables) and staging chunks (the rest), each kind pooled within its
// share, and a call short of its kind's share waits for an earlier
// ticket instead of freeing the other kind's idle memory. cuMemFree can
// wait for the whole device to go idle, which never happened while a
// stream waited on a counter that only the submitting thread's later
// work wrote (transfer's early events, since retired); it also costs
// milliseconds on the submitting thread. It reports false, and changes
// nothing, when the bound is too small to split (less than two tables and
// a chunk).
func (c *Copier) KeepIdle() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	tb := c.descBytes()
	capT := max(2*tb, c.opts.MaxDeviceBytes/8/tb*tb)
	if c.opts.MaxDeviceBytes-capT < int64(c.opts.GatherChunkBytes) {
		return false
	}
	// What New and Prewarm allocated may exceed the shares: free the idle
	// excess now (called before any copy is in flight, so cuMemFree waits
	// for nothing), or refuse if copies still hold it.
	chunk := int64(c.opts.GatherChunkBytes)
	for int64(len(c.all))*tb > capT && len(c.free) > 0 {
		b := c.free[len(c.free)-1]
		c.free = c.free[:len(c.free)-1]
		c.all = slices.DeleteFunc(c.all, func(q *descBuf) bool { return q == b })
		if err := errors.Join(c.devFreeLocked(b.dev, uint64(tb)), c.drv.MemFreeHost(b.host)); err != nil {
			return false
		}
	}
	other := func() int64 { return c.devBytes - int64(len(c.all))*tb }
	for other() > c.opts.MaxDeviceBytes-capT && len(c.stagingFree) > 0 {
		p := c.stagingFree[len(c.stagingFree)-1]
		c.stagingFree = c.stagingFree[:len(c.stagingFree)-1]
		c.stagingAll = slices.DeleteFunc(c.stagingAll, func(q cuda.DevicePtr) bool { return q == p })
		if err := c.devFreeLocked(p, uint64(chunk)); err != nil {
			return false
		}
	}
	if int64(len(c.all))*tb > capT || other() > c.opts.MaxDeviceBytes-capT {
		return false
	}
	c.tableCap = capT
	return true
}

// PrewarmEvents creates events into the copier's pool until it holds n,
// so that the first copies (a staged copy takes two a staging chunk of its
// ring, a launch of the kernel path its own) do not create them on their
// submitting thread.
func (c *Copier) PrewarmEvents(n int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.eventsFree) < n {
		e, err := c.drv.EventCreate(cuda.EventDisableTiming)
		if err != nil {
			return fmt.Errorf("cudacopy: copy event: %w", err)
		}
		c.eventsAll = append(c.eventsAll, e)
		c.eventsFree = append(c.eventsFree, e)
	}
	return nil
}

// Prewarm allocates, within MaxDeviceBytes, what the first copies would
// otherwise allocate on their submitting thread: tables descriptor tables
// (with their pinned host halves) and the staging chunks of rings
// concurrent gathered or scattered copies (NoGather: none), kept idle in
// the pools. It stops quietly at the bound (or at the KeepIdle shares),
// so that the engine's first op runs as fast as later ones.
func (c *Copier) Prewarm(tables, rings int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for range tables {
		if ok, err := c.makeRoomLocked(need{bufs: len(c.free) + 1}, 0); err != nil || !ok {
			return err
		}
		b, err := c.newDescBuf()
		if err != nil {
			return err
		}
		c.free = append(c.free, b)
	}
	if c.opts.NoGather {
		return nil
	}
	for range rings * c.opts.GatherRing {
		if ok, err := c.makeRoomLocked(need{staging: len(c.stagingFree) + 1}, 0); err != nil || !ok {
			return err
		}
		p, err := c.devAllocLocked(uint64(c.opts.GatherChunkBytes))
		if err != nil {
			return err
		}
		c.stagingAll = append(c.stagingAll, p)
		c.stagingFree = append(c.stagingFree, p)
	}
	return nil
}
