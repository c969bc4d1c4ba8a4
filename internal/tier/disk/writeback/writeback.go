// Package writeback is the disk tier's eviction write-back, shared by the
// embedded engine's tier (offload) and the node pool's (nodepool): it
// writes the blocks a kvcache.Cache evicts to an internal/tier/disk Store, in the
// background, and keeps them readable until they are written.
//
// A Writer owns, for one Store and one cache:
//
//   - admission accounting: at most MaxBusy write-backs accepted and not
//     finished at once (beyond that an eviction is dropped, counted in
//     Dropped), each of a clear generation (Clear counts them);
//   - the slots accepted to go "demoting" (Demote said true), by slot and
//     generation, until the cache hands them to OnDemote;
//   - MaxBusy copy buffers (disk.AlignedBuffer, allocated as first needed)
//     for the blocks copied out of a slot that could not wait (Demote's
//     needed, or Copy);
//   - the queue of write-backs and the writer goroutines that Put each one,
//     from its demoting slot or from its copy, then finish it;
//   - the write-backs in flight by key, readable meanwhile: Contains counts
//     them, Get copies from them (Served) instead of reading a record.
//
// Its owner keeps the admission filter (Demote is called for admitted
// keys only), write-throughs of its own, and what a slot is (Bytes) and
// how a demoting one is given back (Demoted).
//
// Invariants:
//
//   - Lock order: the cache's lock (Demote runs under it), then the
//     Writer's close lock (read), then its busy lock. Nothing here takes
//     the cache's lock except through Demoted, which runs with no lock of
//     the Writer held: finish calls it from a writer, or OnDemote after
//     Close.
//   - Demote and OnDemote never wait: a copy buffer is free and the queue
//     has room for every accepted write-back (both hold MaxBusy).
//   - A write-back stays readable until it is finished: its bytes (the
//     demoting slot's or the copy's) are not given back before its readers
//     are done.
//   - A record written for a key deleted (Delete) or cleared (Clear) after
//     its write-back was accepted is deleted once written, and such a
//     write-back is not served meanwhile. Delete and Clear mark before the
//     Store deletes, and finish looks after the Put returned: a record
//     neither saw is removed by finish.
//   - One key's write-backs are Put one at a time, in the order they were
//     accepted: a later one a writer takes first is parked and written
//     by whoever finishes the one before (after Close: dropped with it),
//     so a record deleted once written (above) never takes the next
//     write-back's record with it, also when the earlier one is accepted
//     from its slot and queued only later, by OnDemote
//     (TestDeletedThenStoredAgain, TestDeletedThenStoredAgainFromSlot).
//     No writer waits for another's write-back.
//   - Every accepted write-back finishes once: written or not, its buffer
//     or demoting slot is given back, also after Close (OnDemote of a slot
//     accepted before Close gives it back unwritten, counted in Dropped).
package writeback

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/kvoffload/kvoffload/internal/tier/disk"
	"github.com/kvoffload/kvoffload/kvcache"
)

// Config describes a Writer.
type Config struct {
	// Store is where the blocks are written. The Writer does not close it.
	Store *disk.Store
	// SlotBytes is a block's size (a slot's, a record's payload, a copy
	// buffer's).
	SlotBytes int
	// MaxBusy bounds the write-backs accepted and not finished; at least 1.
	MaxBusy int
	// Writers is the number of writer goroutines (Start).
	Writers int
	// Bytes returns slot s's bytes, nil when its memory is gone. It runs
	// under the cache's lock (Demote) and in the writers (a demoting slot,
	// whose memory stays): it must not take a lock the cache's lock is
	// taken under.
	Bytes func(s kvcache.Slot) []byte
	// Demoted gives a demoting slot back once its write-back finished
	// (kvcache.Cache.Demoted and what the owner does after). No lock of
	// the Writer is held.
	Demoted func(s kvcache.Slot)
	// BeforePut (tests) runs in a writer before each Put; BeforeGet
	// before each Get.
	BeforePut, BeforeGet func(kvcache.Key)
	// TombKeys has Delete mark the keys themselves until no write-back is
	// unfinished, not only their write-backs in flight: a write-back of
	// such a key accepted after the Delete (the key stored and evicted
	// again meanwhile) is not served either, and its record is deleted once
	// written. Without it, Delete marks the write-backs in flight for the
	// keys, and a later one is served and kept.
	TombKeys bool
}

// Writer is the write-back machine of one Store (see the package
// comment). Its counters are the owner's to read, and to add its own
// writes to.
type Writer struct {
	cfg Config

	bufs  chan []byte // copy buffers, MaxBusy of them (nil: not allocated yet)
	queue chan job    // room for MaxBusy

	mu     sync.RWMutex // closed; held (read) while queueing
	closed bool
	wg     sync.WaitGroup

	busyMu sync.Mutex
	busy   int                    // write-backs accepted and not finished (≤ MaxBusy)
	idle   chan struct{}          // closed when busy drops to 0
	accept map[slotGen]*writeBack // accepted to go demoting, until OnDemote
	// flight holds the write-backs accepted and not finished by key:
	// readable meanwhile; finish waits for their readers (readDone, on
	// busyMu) before giving their bytes back.
	flight   map[kvcache.Key]*writeBack
	readDone *sync.Cond
	tomb     map[kvcache.Key]struct{} // TombKeys: keys deleted while busy > 0
	// order holds each key's unfinished write-backs in the order they
	// were accepted: one is Put only once it is its key's first, so an
	// older one of the key, deleted meanwhile, deletes its record before
	// the newer one writes its own (in the other order it deleted the
	// newer record). A job a writer takes before its turn is parked (by
	// its write-back) and run by whoever finishes its predecessor: nobody
	// waits, even for a predecessor accepted from its slot and not queued
	// yet (OnDemote comes when the slot's readers are done).
	order  map[kvcache.Key][]*writeBack
	parked map[*writeBack]job
	// clearGen counts Clears: a write-back accepted before one is not
	// served and is deleted once written.
	clearGen atomic.Uint64

	// Writes and WriteErrors count the Puts (internal/nodepool's Stats
	// DiskWrites, DiskWriteErrors; offload's Stats.Disk.Writes,
	// Disk.WriteErrors), Dropped the evictions past MaxBusy or after Close
	// (DiskDropped; Disk.Dropped), Copies the evictions copied out under the
	// cache's lock (DiskCopies; Disk.Copies), Served the Gets served from a
	// write-back in flight (DiskHitsWriting; Disk.HitsWriting).
	Writes, WriteErrors, Dropped, Copies, Served atomic.Int64
}

// slotGen names one occupancy of a slot.
type slotGen struct {
	id  kvcache.SlotID
	gen uint32
}

// writeBack is a block being written that readers may copy from: src
// holds its bytes (the demoting slot, or a copy buffer), gen is the clear
// generation it was accepted in, gone is set by a Delete of its key. On
// busyMu.
type writeBack struct {
	src     []byte
	gen     uint64
	readers int
	gone    bool
}

// job is a write-back for a writer: from slot (demoting) when fromSlot,
// else from buf (a copy).
type job struct {
	key      kvcache.Key
	slot     kvcache.Slot
	fromSlot bool
	buf      []byte
	wb       *writeBack // its entry in flight
}

// New returns a Writer; Start starts its writers.
func New(cfg Config) *Writer {
	cfg.MaxBusy = max(cfg.MaxBusy, 1)
	w := &Writer{cfg: cfg, bufs: make(chan []byte, cfg.MaxBusy), queue: make(chan job, cfg.MaxBusy),
		accept: map[slotGen]*writeBack{}, flight: map[kvcache.Key]*writeBack{}, tomb: map[kvcache.Key]struct{}{},
		order: map[kvcache.Key][]*writeBack{}, parked: map[*writeBack]job{}}
	w.readDone = sync.NewCond(&w.busyMu)
	for range cfg.MaxBusy {
		w.bufs <- nil
	}
	return w
}

// Start starts the writer goroutines (Config.Writers). The write-backs
// accepted before wait in the queue.
func (w *Writer) Start() {
	w.wg.Add(w.cfg.Writers)
	for range w.cfg.Writers {
		go w.writer()
	}
}

// Close writes what is queued (giving the demoting slots back), stops
// the writers and returns true; false if it was closed already. A
// write-back accepted after it is dropped. The Store stays open.
func (w *Writer) Close() bool {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return false
	}
	w.closed = true
	close(w.queue)
	w.mu.Unlock()
	w.wg.Wait()
	return true
}

// Demote is the cache's Config.Demote for an admitted key, under its
// lock: it accepts an evicted block for a write-back if it is not on disk
// or in flight already (a promoted block evicted again), its bytes are
// there and fewer than MaxBusy write-backs are unfinished; otherwise it is
// dropped (counted, but for a block on disk). An accepted block evicted
// ahead of demand (not needed) is written from its slot: true, the slot
// goes demoting, to OnDemote. One the evicting store needs at once (its
// slot is reused once the cache's critical section ends) is copied now,
// its bytes intact (a ready block), into a buffer a writer Puts (Copies):
// a memcpy of one block under the cache's lock. Never waits.
func (w *Writer) Demote(s kvcache.Slot, k kvcache.Key, needed bool) bool {
	if w.Contains(k) {
		return false
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	mem := w.cfg.Bytes(s)
	if mem == nil {
		w.Dropped.Add(1)
		return false
	}
	w.busyMu.Lock()
	gen, ok := w.acceptLocked()
	if !ok {
		w.busyMu.Unlock()
		return false
	}
	if !needed {
		// Readable from the slot at once: from here until Demoted the slot
		// is releasing, then demoting, never reused.
		wb := &writeBack{src: mem, gen: gen}
		w.accept[slotGen{s.ID, s.Gen}], w.flight[k] = wb, wb
		w.order[k] = append(w.order[k], wb)
		w.busyMu.Unlock()
		return true
	}
	w.busyMu.Unlock()
	w.queueCopy(k, mem, gen)
	w.Copies.Add(1)
	return false
}

// OnDemote is the cache's Config.OnDemote: slot s, demoting (Demote
// accepted it), is queued for a writer, which Puts it straight from the
// slot's memory and gives it back (Demoted). Never blocks. After Close it
// is given back unwritten, counted in Dropped.
func (w *Writer) OnDemote(s kvcache.Slot, k kvcache.Key) {
	w.busyMu.Lock()
	j := job{key: k, slot: s, fromSlot: true, wb: w.accept[slotGen{s.ID, s.Gen}]}
	delete(w.accept, slotGen{s.ID, s.Gen})
	w.busyMu.Unlock()
	w.mu.RLock()
	if !w.closed {
		w.queue <- j
		w.mu.RUnlock()
		return
	}
	w.mu.RUnlock()
	// Not under mu: Demoted takes the cache's lock, under which Demote
	// takes mu. A later write-back of its key parked for it is dropped too
	// (the writers are gone).
	for ok := true; ok; {
		w.Dropped.Add(1)
		j, ok = w.finish(j, false)
	}
}

// Copy writes key k's block, mem (which the caller holds until Copy
// returns), to the Store in the background: copied into a buffer now,
// Put by a writer, readable meanwhile. Nothing when k is on disk or in
// flight already; dropped, counted, when MaxBusy write-backs are
// unfinished or the Writer is closed. True when it was queued. Never
// waits.
func (w *Writer) Copy(k kvcache.Key, mem []byte) bool {
	if w.Contains(k) {
		return false
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	w.busyMu.Lock()
	gen, ok := w.acceptLocked()
	w.busyMu.Unlock()
	if !ok {
		return false
	}
	w.queueCopy(k, mem, gen)
	return true
}

// acceptLocked (busyMu and mu held) accepts one more write-back if the
// Writer is open and fewer than MaxBusy are unfinished, and returns the
// clear generation it belongs to; otherwise it counts a drop.
func (w *Writer) acceptLocked() (gen uint64, ok bool) {
	if w.closed || w.busy >= w.cfg.MaxBusy {
		w.Dropped.Add(1)
		return 0, false
	}
	if w.busy == 0 {
		w.idle = make(chan struct{})
	}
	w.busy++
	return w.clearGen.Load(), true
}

// queueCopy (mu held, read) copies mem into a free buffer (one is free
// for every accepted write-back), makes it readable as key k's, of clear
// generation gen, and queues it.
func (w *Writer) queueCopy(k kvcache.Key, mem []byte, gen uint64) {
	buf := <-w.bufs
	if buf == nil {
		buf = disk.AlignedBuffer(w.cfg.SlotBytes)
	}
	copy(buf, mem)
	wb := &writeBack{src: buf, gen: gen}
	w.busyMu.Lock()
	w.flight[k] = wb
	w.order[k] = append(w.order[k], wb)
	w.busyMu.Unlock()
	w.queue <- job{key: k, buf: buf, wb: wb}
}

func (w *Writer) writer() {
	defer w.wg.Done()
	for j := range w.queue {
		if !w.takeTurn(j) {
			continue // parked: its predecessor's finisher runs it
		}
		for ok := true; ok; {
			j, ok = w.write(j)
		}
	}
}

// takeTurn reports whether j's write-back is the first unfinished one of
// its key; if not, it parks j for the finish of the one before.
func (w *Writer) takeTurn(j job) bool {
	if j.wb == nil {
		return true
	}
	w.busyMu.Lock()
	defer w.busyMu.Unlock()
	if q := w.order[j.key]; len(q) > 0 && q[0] != j.wb {
		w.parked[j.wb] = j
		return false
	}
	return true
}

// write Puts j and finishes it; it returns the key's next job if it was
// parked waiting for this one (next: true), for the caller to write.
func (w *Writer) write(j job) (next job, ok bool) {
	if w.cfg.BeforePut != nil {
		w.cfg.BeforePut(j.key)
	}
	payload := j.buf
	if payload == nil {
		payload = w.cfg.Bytes(j.slot) // demoting: its memory stays
	}
	written := false
	if err := w.cfg.Store.Put(j.key, payload); err != nil {
		w.WriteErrors.Add(1)
	} else {
		w.Writes.Add(1)
		written = true
	}
	return w.finish(j, written)
}

// finish ends a write-back: a record written for a key deleted or cleared
// meanwhile is deleted; it stops being readable, its readers done; the
// buffer or the demoting slot is given back. It returns the key's next
// write-back's job when that was parked waiting for this one (ok), which
// the caller writes (a writer) or drops (after Close).
func (w *Writer) finish(j job, written bool) (next job, ok bool) {
	wb := j.wb
	w.busyMu.Lock()
	// Read after the Put returned: a Delete marks before it deletes from
	// the Store, a Clear bumps clearGen before it clears, so a record
	// neither saw is removed here. (wb is always set: Demote made it.)
	gone := wb == nil || w.goneLocked(j.key, wb)
	w.busyMu.Unlock()
	if written && gone {
		w.cfg.Store.Delete(j.key)
	}
	if wb != nil {
		w.busyMu.Lock()
		if w.flight[j.key] == wb {
			delete(w.flight, j.key)
		}
		// The key's next write-back may Put now: this one's record is
		// written, or deleted if it was gone.
		next, ok = w.leaveOrderLocked(j.key, wb)
		for wb.readers > 0 {
			w.readDone.Wait()
		}
		w.busyMu.Unlock()
	}
	switch {
	case j.buf != nil:
		w.bufs <- j.buf
	case j.fromSlot:
		w.cfg.Demoted(j.slot)
	}
	w.busyMu.Lock()
	if w.busy--; w.busy == 0 {
		clear(w.tomb)
		close(w.idle)
	}
	w.busyMu.Unlock()
	return next, ok
}

// leaveOrderLocked (busyMu held) takes wb out of key k's order; when it
// was the first and the next one's job is parked, it returns that job,
// unparked.
func (w *Writer) leaveOrderLocked(k kvcache.Key, wb *writeBack) (next job, ok bool) {
	q := w.order[k]
	i := slices.Index(q, wb)
	if i < 0 {
		return job{}, false
	}
	q = slices.Delete(q, i, i+1)
	if len(q) == 0 {
		delete(w.order, k)
		return job{}, false
	}
	w.order[k] = q
	if i == 0 {
		if next, ok = w.parked[q[0]]; ok {
			delete(w.parked, q[0])
		}
	}
	return next, ok
}

// goneLocked (busyMu held) reports whether key k's write-back wb was
// deleted or cleared since it was accepted.
func (w *Writer) goneLocked(k kvcache.Key, wb *writeBack) bool {
	if wb.gone || wb.gen != w.clearGen.Load() {
		return true
	}
	_, deleted := w.tomb[k]
	return deleted
}

// Delete removes keys from the Store and from the write-backs in flight:
// those are marked first (no longer served, their records deleted once
// written; with TombKeys the keys themselves), then the Store deletes. (The
// other order missed a Put that ended between the two.)
func (w *Writer) Delete(keys []kvcache.Key) {
	w.busyMu.Lock()
	if w.busy > 0 {
		for _, k := range keys {
			if wb := w.flight[k]; wb != nil {
				wb.gone = true
			}
			if w.cfg.TombKeys {
				w.tomb[k] = struct{}{}
			}
		}
	}
	w.busyMu.Unlock()
	for _, k := range keys {
		w.cfg.Store.Delete(k)
	}
}

// Clear removes every record, and the write-backs in flight (no longer
// served, their records deleted once written).
func (w *Writer) Clear() {
	w.clearGen.Add(1)
	w.cfg.Store.Clear()
}

// Flush waits until no write-back is unfinished, or ctx ends.
func (w *Writer) Flush(ctx context.Context) error {
	for {
		w.busyMu.Lock()
		if w.busy == 0 {
			w.busyMu.Unlock()
			return nil
		}
		ch := w.idle
		w.busyMu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Contains reports whether key k's block is on disk or in flight (readable):
// memory only, never I/O.
func (w *Writer) Contains(k kvcache.Key) bool {
	if w.cfg.Store.Contains(k) {
		return true
	}
	w.busyMu.Lock()
	defer w.busyMu.Unlock()
	return w.servableLocked(k) != nil
}

// Prefix returns how many leading keys Contains (memory only).
func (w *Writer) Prefix(keys []kvcache.Key) int {
	for i, k := range keys {
		if !w.Contains(k) {
			return i
		}
	}
	return len(keys)
}

// servableLocked (busyMu held) returns key k's write-back in flight if a
// reader may copy from it: not deleted or cleared since it was accepted.
func (w *Writer) servableLocked(k kvcache.Key) *writeBack {
	wb := w.flight[k]
	if wb == nil || w.goneLocked(k, wb) {
		return nil
	}
	return wb
}

// Get reads key k's block into mem (BeforeGet first): from its write-back
// in flight if there is one a reader may use (Served: a block evicted a
// moment ago reloads before its record is written, without a disk read),
// else from its record. True when mem holds the verified block.
func (w *Writer) Get(k kvcache.Key, mem []byte) bool {
	if w.cfg.BeforeGet != nil {
		w.cfg.BeforeGet(k)
	}
	w.busyMu.Lock()
	if wb := w.servableLocked(k); wb != nil {
		wb.readers++
		w.busyMu.Unlock()
		copy(mem, wb.src)
		w.busyMu.Lock()
		if wb.readers--; wb.readers == 0 {
			w.readDone.Broadcast()
		}
		w.busyMu.Unlock()
		w.Served.Add(1)
		return true
	}
	w.busyMu.Unlock()
	found, err := w.cfg.Store.Get(k, mem)
	return found && err == nil
}
