package main

import (
	"fmt"
	"io"
	"time"

	"github.com/schollz/progressbar/v3"
)

// demoBar is the progress bar (a no-op without a writer).
type demoBar struct {
	bar *progressbar.ProgressBar
	cfg demoConfig
}

func newDemoBar(w io.Writer, cfg demoConfig) *demoBar {
	if w == nil {
		return &demoBar{}
	}
	return &demoBar{cfg: cfg, bar: progressbar.NewOptions(1000, progressbar.OptionSetWriter(w),
		progressbar.OptionSetDescription("serving"), progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish(),
		progressbar.OptionSetPredictTime(false))}
}

// update moves the bar to the fraction of the run done (by time or by
// requests, whichever bound is nearer).
func (b *demoBar) update(rep *demoReport, elapsed time.Duration) {
	if b.bar == nil {
		return
	}
	var frac float64
	if b.cfg.duration > 0 {
		frac = elapsed.Seconds() / b.cfg.duration.Seconds()
	}
	if b.cfg.requests > 0 {
		frac = max(frac, float64(rep.Requests)/float64(b.cfg.requests))
	}
	b.bar.Describe(fmt.Sprintf("%d requests, %.0f%% host hits, %d verified", rep.Requests, 100*rep.Blocks.ratio(rep.Blocks.HostHits), rep.Verified))
	_ = b.bar.Set(int(min(frac, 1) * 1000))
}

func (b *demoBar) finish() {
	if b.bar != nil {
		_ = b.bar.Finish()
	}
}
