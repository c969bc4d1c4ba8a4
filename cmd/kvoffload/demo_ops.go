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
	if err != nil {
		return fmt.Errorf("storing %d blocks: %w", len(vs), err)
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
			s.Failed++
		}
	}
	if werr != nil && r.rep.FirstEngineError == "" {
		r.rep.FirstEngineError = werr.Error()
	}
	return nil
}

// load loads keys into ids with the lease from Lookup and waits; it
// returns the indices loaded and the indices to recompute instead.
func (r *demoRun) load(keys []offload.Key, ids []int, lease *offload.Lease) (loaded, missing []int, err error) {
	if len(keys) == 0 {
		return nil, nil, nil
	}
	cpu0, t0 := cpuTime(), time.Now()
	op, err := r.eng.Load(context.Background(), keys, ids, offload.LoadOptions{Lease: lease})
	if errors.Is(err, offload.ErrBusy) {
		r.rep.Load.Busy++
		for i := range keys {
			missing = append(missing, i)
		}
		return nil, missing, releaseLease(lease)
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
	for i, oc := range out {
		switch oc {
		case offload.OutcomeLoaded:
			l.Blocks++
			loaded = append(loaded, i)
		case offload.OutcomeFailed:
			l.Failed++
			missing = append(missing, i)
		default:
			l.Missing++
			missing = append(missing, i)
		}
	}
	if werr != nil && r.rep.FirstEngineError == "" {
		r.rep.FirstEngineError = werr.Error()
	}
	return loaded, missing, nil
}

func releaseLease(l *offload.Lease) error {
	if l == nil {
		return nil
	}
	return l.Release()
}
