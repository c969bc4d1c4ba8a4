package main

import (
	"context"
	"encoding/binary"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvoffload/kvoffload/offload"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/stretchr/testify/require"
)

// TestDemoMetricsAndEvents runs the demo with --metrics and --events on
// free ports: a scrape during the run parses with the Prometheus text
// parser, and a ZeroMQ subscriber hears KV event batches, the last one
// after the engine closed.
func TestDemoMetricsAndEvents(t *testing.T) {
	cfg := tinyDemo(offload.BackendHost)
	cfg.duration, cfg.requests = 0, 300
	cfg.metricsAddr, cfg.eventsAddr = "127.0.0.1:0", "tcp://127.0.0.1:0"
	var mu sync.Mutex
	var metricsURL, eventsAddr string
	notice := func(s string) {
		mu.Lock()
		defer mu.Unlock()
		if i := strings.Index(s, "http://"); i >= 0 {
			metricsURL = s[i:]
		}
		if i := strings.Index(s, "tcp://"); i >= 0 {
			eventsAddr = s[i:]
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var sub zmq4.Socket
	batches := make(chan uint64, 1<<16)
	scraped := 0
	cfg.afterRequest = func(eng *offload.Engine, _ []offload.Key) error {
		mu.Lock()
		defer mu.Unlock()
		if sub == nil {
			sub = zmq4.NewSub(ctx)
			require.NoError(t, sub.Dial(eventsAddr))
			require.NoError(t, sub.SetOption(zmq4.OptionSubscribe, ""))
			go func() {
				for {
					m, err := sub.Recv()
					if err != nil {
						return
					}
					if len(m.Frames) == 3 {
						batches <- binary.BigEndian.Uint64(m.Frames[1])
					}
				}
			}()
			time.Sleep(50 * time.Millisecond) // let the subscription reach the publisher
		}
		if scraped < 2 {
			resp, err := http.Get(metricsURL)
			require.NoError(t, err)
			defer resp.Body.Close()
			p := expfmt.NewTextParser(model.UTF8Validation)
			mfs, err := p.TextToMetricFamilies(resp.Body)
			require.NoError(t, err)
			require.Contains(t, mfs, "kvoffload_cpu_block_hit_total")
			require.Contains(t, mfs, "kvoffload_transfer_latency_seconds")
			scraped++
		}
		return nil
	}
	rep, err := runDemo(context.Background(), cfg, nil, notice)
	require.NoError(t, err)
	require.Positive(t, rep.Store.Blocks)
	require.Equal(t, 2, scraped)
	var n int
	for deadline := time.After(5 * time.Second); ; {
		select {
		case <-batches:
			n++
			continue
		case <-deadline:
		case <-time.After(500 * time.Millisecond):
		}
		break
	}
	require.Positive(t, n, "the subscriber heard event batches")
	mu.Lock()
	defer mu.Unlock()
	_ = sub.Close()
}
