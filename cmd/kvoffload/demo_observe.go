package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/kvoffload/kvoffload/events"
	"github.com/kvoffload/kvoffload/metrics"
)

// observe starts what --metrics and --events ask for on the demo's engine:
// an HTTP server of /metrics and a ZeroMQ publisher of the engine's KV
// events. They stop after the engine closes (opened.close is wrapped), so
// that the last scrape sees the final counters and the publisher sends
// the AllBlocksCleared of the close.
func observe(o *opened, cfg demoConfig, notice func(string)) error {
	var stops []func() error
	if cfg.metricsAddr != "" {
		ln, err := net.Listen("tcp", cfg.metricsAddr)
		if err != nil {
			return fmt.Errorf("--metrics %s: %w", cfg.metricsAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", metrics.Handler(o.eng))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		notice("serving Prometheus metrics at http://" + ln.Addr().String() + "/metrics")
		stops = append(stops, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return srv.Shutdown(ctx)
		})
	}
	if cfg.eventsAddr != "" {
		pub, err := events.Listen(context.Background(), cfg.eventsAddr, events.Options{})
		if err != nil {
			for _, stop := range stops {
				_ = stop()
			}
			return fmt.Errorf("--events %s: %w", cfg.eventsAddr, err)
		}
		stream := o.eng.Events(0)
		done := make(chan error, 1)
		go func() { done <- pub.Run(context.Background(), stream) }()
		notice("publishing KV events on a ZeroMQ PUB socket at tcp://" + pub.Addr().String())
		stops = append(stops, func() error {
			var err error
			select {
			case err = <-done: // the engine closed: the stream ended
			case <-time.After(5 * time.Second):
				stream.Close()
				err = <-done
			}
			if n := stream.Dropped(); n > 0 {
				notice(fmt.Sprintf("%d KV events dropped (the publisher fell behind)", n))
			}
			return errors.Join(err, pub.Close())
		})
	}
	if len(stops) == 0 {
		return nil
	}
	closeEngine := o.close
	o.close = func() error {
		err := closeEngine()
		for _, stop := range stops {
			err = errors.Join(err, stop())
		}
		return err
	}
	return nil
}
