//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>
*/
import "C"

import (
	"context"
	"time"

	"github.com/kvoffload/kvoffload/offload"
)

// kvoGo_prefetch is kvo_prefetch: Engine.Prefetch of n keys, timeoutNS its
// PrefetchOptions.Timeout (0: the cluster tier's; negative: KVO_EINVAL,
// from Prefetch), the counts written where the pointers are not NULL.
//
//export kvoGo_prefetch
func kvoGo_prefetch(h C.uint64_t, keysP *C.uint8_t, n C.size_t, timeoutNS C.int64_t, promoted, fromDisk, fromCluster *C.size_t) (rc C.int) {
	defer guard(&rc)
	eng, keys, err := engineKeys(h, keysP, n)
	if err != nil {
		return fail(err)
	}
	res, err := eng.Prefetch(context.Background(), keys, offload.PrefetchOptions{Timeout: time.Duration(timeoutNS)})
	if err != nil {
		return fail(err)
	}
	for _, o := range []struct {
		p *C.size_t
		v int
	}{{promoted, res.Promoted}, {fromDisk, res.FromDisk}, {fromCluster, res.FromCluster}} {
		if o.p != nil {
			*o.p = C.size_t(o.v)
		}
	}
	return codeOK
}

// kvoGo_prefetch_background is kvo_prefetch_background: Engine.Prefetch
// with PrefetchBestEffort; *started (if not NULL) says whether it started.
//
//export kvoGo_prefetch_background
func kvoGo_prefetch_background(h C.uint64_t, keysP *C.uint8_t, n C.size_t, timeoutNS C.int64_t, started *C.int) (rc C.int) {
	defer guard(&rc)
	eng, keys, err := engineKeys(h, keysP, n)
	if err != nil {
		return fail(err)
	}
	res, err := eng.Prefetch(context.Background(), keys, offload.PrefetchOptions{Timeout: time.Duration(timeoutNS), Policy: offload.PrefetchBestEffort})
	if err != nil {
		return fail(err)
	}
	if started != nil {
		*started = 0
		if res.Background {
			*started = 1
		}
	}
	return codeOK
}
