package main

import (
	"errors"
	"fmt"

	"github.com/kvoffload/kvoffload/offload"
)

// nodeGone reports whether err is the node of a --connect engine gone
// (offload.ErrUnavailable: unreachable or restarting, a store it did not
// commit, a load whose node region is gone from this process). The design
// names these as expected outcomes of a node restart, which a serving
// loop meets by recomputing the blocks and carrying on: the engine
// reconnects by itself, and the new node's pool is empty (misses, never a
// wrong block). The first such error is kept for the report, and the
// start of each outage noticed.
func (r *demoRun) nodeGone(err error) bool {
	if r.cfg.connect == "" || err == nil || !errors.Is(err, offload.ErrUnavailable) {
		return false
	}
	if r.rep.FirstNodeError == "" {
		r.rep.FirstNodeError = err.Error()
	}
	if !r.nodeDown {
		r.nodeDown = true
		if r.notice != nil {
			r.notice(fmt.Sprintf("the node is unavailable (%v): recomputing its blocks while the engine reconnects", err))
		}
	}
	return true
}

// noteResult records an op's error: a failure of the engine's (the first
// kept for the report), or, gone, the node's (nodeGone counted it). An op
// without error ends an outage.
func (r *demoRun) noteResult(werr error, gone bool) {
	switch {
	case werr == nil:
		r.nodeDown = false
	case !gone && r.rep.FirstEngineError == "":
		r.rep.FirstEngineError = werr.Error()
	}
}

// nodeReport fills in the node's side of the report (--connect): the
// restarts the engine reconnected across.
func (r *demoRun) nodeReport(st offload.Stats) {
	if r.cfg.connect != "" && st.Node.Connections > 1 {
		r.rep.NodeReconnects = int(st.Node.Connections - 1)
	}
}
