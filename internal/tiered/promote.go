package tiered

import "github.com/kvoffload/kvoffload/kvcache"

// Completer ends reservations: kvcache.Cache's CompleteStore (and the
// engine's index's).
type Completer interface {
	CompleteStore(slots []kvcache.Slot, err error) error
}

// Settle ends a promotion's reservations once their reads are done:
// slots[i] whose read succeeded (ok[i]; a slot past len(ok) failed) is
// made ready, the others are released with miss (a record missing,
// damaged or late: never made ready), the bad ones first; count (may be
// nil) gets the good and bad counts before either completion. It returns
// how many were good, and the error of the good ones' completion (its
// blocks are then not ready).
func Settle(c Completer, slots []kvcache.Slot, ok []bool, miss error, count func(good, bad int)) (good int, err error) {
	var g, b []kvcache.Slot
	for i, s := range slots {
		if i < len(ok) && ok[i] {
			g = append(g, s)
		} else {
			b = append(b, s)
		}
	}
	if count != nil {
		count(len(g), len(b))
	}
	if len(b) > 0 {
		_ = c.CompleteStore(b, miss)
	}
	if len(g) > 0 {
		err = c.CompleteStore(g, nil)
	}
	return len(g), err
}
