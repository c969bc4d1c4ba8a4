package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvoffload/kvoffload/offload"
)

// store stores the victims' blocks and waits for the copies: the blocks
// are overwritten next, as a serving stack waits on the store's event
// before its kernels reuse them.
func (r *demoRun) store(vs []victim) error {
	if len(vs) == 0 {
		return nil
	}
	keys := make([]offload.Key, len(vs))
	ids := make([]int, len(vs))
	for i, v := range vs {
		keys[i], ids[i] = v.key, v.id
	}
	cpu0, t0 := cpuTime(), time.Now()
	op, err := r.eng.Store(context.Background(), keys, ids, offload.StoreOptions{After: r.mem.storeAfter()})
	if r.nodeGone(err) {
		r.rep.Store.Unavailable += int64(len(vs))
		return nil
	}
	if err != nil {
		return fmt.Errorf("storing %d blocks: %w", len(vs), err)
	}
	if r.cfg.nodeStep != nil && r.cfg.connect != "" {
		r.cfg.nodeStep("store")
	}
	werr := op.Wait(context.Background())
	lat := time.Since(t0)
	r.rep.CPUSeconds += (cpuTime() - cpu0).Seconds()
	out, err := op.Outcomes()
	if err != nil {
		return errors.Join(err, op.Release())
	}
	if err := op.Release(); err != nil {
		return err
	}
	r.storeLat = append(r.storeLat, lat)
	s := &r.rep.Store
	s.Ops++
	s.Seconds += lat.Seconds()
	// Blocks the node did not commit (it went away during the copies)
	// are not stored: an outcome of a node restart, not a failed copy.
	gone := r.nodeGone(werr)
	for _, oc := range out {
		switch oc {
		case offload.OutcomeStored:
			s.Blocks++
		case offload.OutcomeAlreadyPresent:
			s.AlreadyPresent++
		case offload.OutcomeRefusedFull:
			s.RefusedFull++
		case offload.OutcomeRefusedBusy:
			s.Busy++
		case offload.OutcomeRefusedAdmission:
			s.RefusedAdmission++
		case offload.OutcomeFailed:
			if gone {
				s.Unavailable++
			} else {
				s.Failed++
			}
		}
	}
	r.noteResult(werr, gone)
	return nil
}

// load loads keys into ids with the lease from Lookup and waits; it
// returns the indices loaded and the indices to recompute instead.
func (r *demoRun) load(keys []offload.Key, ids []int, lease *offload.Lease) (loaded, missing []int, err error) {
	if len(keys) == 0 {
		return nil, nil, nil
	}
	if r.cfg.nodeStep != nil && r.cfg.connect != "" && lease != nil {
		r.cfg.nodeStep("load")
	}
	cpu0, t0 := cpuTime(), time.Now()
	op, err := r.eng.Load(context.Background(), keys, ids, offload.LoadOptions{Lease: lease})
	// Busy, or the node gone (the lease's region is gone from this
	// process, the node unreachable): recompute instead (the README's
	// serving loop); a lease of a node gone is given back as a no-op.
	if gone := r.nodeGone(err); gone || errors.Is(err, offload.ErrBusy) {
		if gone {
			r.rep.Load.Unavailable += int64(len(keys))
		} else {
			r.rep.Load.Busy++
		}
		for i := range keys {
			missing = append(missing, i)
		}
		if err := releaseLease(lease); err != nil && !r.nodeGone(err) {
			return nil, nil, err
		}
		return nil, missing, nil
	}
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("loading %d blocks: %w", len(keys), err), releaseLease(lease))
	}
	werr := op.Wait(context.Background())
	lat := time.Since(t0)
	r.rep.CPUSeconds += (cpuTime() - cpu0).Seconds()
	out, err := op.Outcomes()
	if err != nil {
		return nil, nil, errors.Join(err, op.Release())
	}
	if err := op.Release(); err != nil {
		return nil, nil, err
	}
	r.loadLat = append(r.loadLat, lat)
	l := &r.rep.Load
	l.Ops++
	l.Seconds += lat.Seconds()
	gone := r.nodeGone(werr)
	for i, oc := range out {
		switch oc {
		case offload.OutcomeLoaded:
			l.Blocks++
			loaded = append(loaded, i)
		case offload.OutcomeFailed:
			if gone {
				l.Unavailable++
			} else {
				l.Failed++
			}
			missing = append(missing, i)
		default:
			l.Missing++
			missing = append(missing, i)
		}
	}
	r.noteResult(werr, gone)
	return loaded, missing, nil
}

func releaseLease(l *offload.Lease) error {
	if l == nil {
		return nil
	}
	return l.Release()
}
