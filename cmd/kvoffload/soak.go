package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"time"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
	"github.com/kvoffload/kvoffload/transfer"
)

var soakCommand = command{
	name:    "soak",
	summary: "Run the demo's workload for a long time with random Trim, Delete, Clear and engine Close/reopen, verifying every load.",
	details: `The demo's serving loop (every loaded block verified) runs in rounds of 2 to
10 seconds, each on a freshly opened engine (regions of an eighth of the pool) with a
random layout kind and policy, and closed at the round's end. Between requests it deletes some of
the request's keys, clears the namespace, or trims part of the pool, at
random (seeded by --seed). Builds with invariants on (make soak builds with
-tags kvoinvariants) also check the copy gating (host ranges
live for every copy; released regions poisoned) and the block index after
every change. It prints ops, blocks verified and errors; any error, wrong
block or invariant violation makes the exit status non-zero.`,
	flags: func(fs *flag.FlagSet) func(context.Context, *env, []string) error {
		cfg := soakConfig{duration: 5 * time.Minute, backend: offload.BackendAuto, seed: 1, poolBytes: 64 << 20, layout: "tiny"}
		fs.DurationVar(&cfg.duration, "duration", cfg.duration, "run for `time`")
		fs.Var(stringFlag[offload.Backend]{&cfg.backend}, "backend", "engine backend: auto|cuda|host")
		fs.Uint64Var(&cfg.seed, "seed", cfg.seed, "random `seed` of the workload and the disruptions")
		fs.BoolVar(&cfg.json, "json", false, "print the result as JSON")
		fs.Var(sizeFlag{&cfg.poolBytes}, "pool-bytes", "host pool `size` of each engine")
		fs.StringVar(&cfg.layout, "layout", cfg.layout, "model geometry: "+presetNames())
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			res, err := runSoak(ctx, cfg, e.stderr)
			if res != nil {
				if perr := res.print(e.stdout, cfg.json); perr != nil {
					return errors.Join(err, perr)
				}
			}
			return err
		}
	},
}

type soakConfig struct {
	duration  time.Duration
	backend   offload.Backend
	seed      uint64
	json      bool
	poolBytes int64
	layout    string
}

// soakResult is what a soak prints.
type soakResult struct {
	Backend        offload.Backend `json:"backend"`
	Invariants     bool            `json:"invariants"`
	Interrupted    bool            `json:"interrupted"` // a signal ended the soak before its --duration
	Seconds        float64         `json:"seconds"`
	Engines        int             `json:"engines"` // opened and closed
	Requests       int64           `json:"requests"`
	Ops            int64           `json:"ops"` // stores, loads, trims, deletes, clears
	StoreOps       int64           `json:"store_ops"`
	LoadOps        int64           `json:"load_ops"`
	Trims          int64           `json:"trims"`
	TrimmedBytes   int64           `json:"trimmed_bytes"`
	Deletes        int64           `json:"deletes"`
	DeletedBlocks  int64           `json:"deleted_blocks"`
	Clears         int64           `json:"clears"`
	ClearedBlocks  int64           `json:"cleared_blocks"`
	BlocksVerified int64           `json:"blocks_verified"`
	VerifyFailures int64           `json:"verify_failures"`
	FailedCopies   int64           `json:"failed_copies"`
	Violations     int64           `json:"invariant_violations"`
	Errors         int64           `json:"errors"`
	FirstError     string          `json:"first_error,omitempty"`
}

func (r *soakResult) fail(err error) {
	r.Errors++
	if r.FirstError == "" {
		r.FirstError = err.Error()
	}
}

// runSoak runs rounds of the demo until cfg.duration has passed or ctx
// ends. It returns an error when anything went wrong (the result says
// what).
func runSoak(ctx context.Context, cfg soakConfig, notices io.Writer) (*soakResult, error) {
	if cfg.duration <= 0 {
		return nil, fmt.Errorf("%w: --duration %v must be positive", errUsage, cfg.duration)
	}
	// The flags are checked once, as every round would check them.
	for _, kind := range soakLayoutKinds {
		if _, _, err := cfg.round(cfg.duration, kind, offload.PolicyLRU, 0).plan(); err != nil {
			return nil, err
		}
	}
	rng := rand.New(rand.NewPCG(cfg.seed, 0x50a4))
	res := &soakResult{Backend: cfg.backend, Invariants: transfer.InvariantsEnabled()}
	start := time.Now()
	var (
		lastErr string // the error of the round before, "" when it passed
		repeats int    // rounds in a row that failed with lastErr
		stopped error
	)
	for ctx.Err() == nil {
		left := cfg.duration - time.Since(start)
		if left <= 0 {
			break
		}
		d := cfg.round(min(left, time.Duration(2+rng.IntN(9))*time.Second), soakLayoutKinds[rng.IntN(2)],
			[]offload.Policy{offload.PolicyTinyLFU, offload.PolicyLRU}[rng.IntN(2)], rng.Uint64())
		var eng *offload.Engine
		d.afterRequest = func(e *offload.Engine, keys []offload.Key) error {
			eng = e
			return disrupt(ctx, rng, e, keys, res)
		}
		rep, err := runDemo(ctx, d, nil, func(s string) { fmt.Fprintln(notices, "soak:", s) })
		res.Engines++
		if rep != nil {
			res.Backend = rep.Backend
			res.Requests += int64(rep.Requests)
			res.StoreOps += rep.Store.Ops
			res.LoadOps += rep.Load.Ops
			res.BlocksVerified += rep.Verified
			res.VerifyFailures += rep.VerifyFailures
			res.FailedCopies += rep.Store.Failed + rep.Load.Failed
		}
		if err != nil {
			res.fail(fmt.Errorf("round %d (%s, %s, seed %d): %w", res.Engines, d.layoutKind, d.policy, d.seed, err))
		}
		if eng != nil {
			for _, v := range hostsim.InvariantViolations(eng) {
				res.Violations++
				res.fail(v)
			}
		}
		switch {
		case err == nil:
			lastErr, repeats = "", 0
		case err.Error() == lastErr:
			repeats++
		default:
			lastErr, repeats = err.Error(), 1
		}
		if repeats >= soakMaxRepeats {
			stopped = fmt.Errorf("soak: stopped after %d rounds in a row failed with the same error: %w", repeats, err)
			break
		}
	}
	res.Seconds = time.Since(start).Seconds()
	res.Interrupted = ctx.Err() != nil
	res.Ops = res.StoreOps + res.LoadOps + res.Trims + res.Deletes + res.Clears
	if stopped != nil {
		return res, stopped
	}
	if res.Errors > 0 || res.VerifyFailures > 0 || res.FailedCopies > 0 {
		return res, fmt.Errorf("soak: %d errors, %d wrong blocks, %d failed copies (first: %s)", res.Errors, res.VerifyFailures, res.FailedCopies, res.FirstError)
	}
	return res, nil
}

// soakLayoutKinds are the GPU cache layouts the rounds pick from.
var soakLayoutKinds = []offload.LayoutKind{offload.LayoutLayerSeparate, offload.LayoutCrossLayer}

// soakMaxRepeats is how many rounds in a row may fail with the same error
// before the soak stops with it: an error every round meets (a device
// gone, memory that is not there) is reported once, not once per round
// until the duration ends.
const soakMaxRepeats = 3

// round is the demo one round runs: a fresh engine of cfg's pool in
// regions of an eighth of it (at least 1 MiB and one block), no pinning,
// every loaded block verified.
func (cfg soakConfig) round(d time.Duration, kind offload.LayoutKind, policy offload.Policy, seed uint64) demoConfig {
	region := max(cfg.poolBytes/8, 1<<20)
	if shape, ok := layoutPresets[cfg.layout]; ok {
		region = max(region, cacheLayout{shape: shape, kind: kind}.blockBytes())
	}
	return demoConfig{duration: d, poolBytes: cfg.poolBytes, layoutName: cfg.layout, layoutKind: kind,
		backend: cfg.backend, pinning: string(offload.PinNone), policy: policy, seed: seed, verify: true, regionBytes: region}
}

// disrupt does, at random after a request, one of: delete some of the
// request's keys (2%), clear the engine's namespace (0.3%), trim a region's worth
// or so of the pool (0.3%); and checks the gating invariants.
func disrupt(ctx context.Context, rng *rand.Rand, e *offload.Engine, keys []offload.Key, res *soakResult) error {
	switch p := rng.Float64(); {
	case p < 0.02 && len(keys) > 0:
		lo := rng.IntN(len(keys))
		n, err := e.Delete(keys[lo : lo+1+rng.IntN(len(keys)-lo)])
		if err != nil {
			return fmt.Errorf("soak: delete: %w", err)
		}
		res.Deletes++
		res.DeletedBlocks += int64(n)
	case p < 0.023:
		n, err := e.Clear(e.Config().Namespace)
		if err != nil {
			return fmt.Errorf("soak: clear: %w", err)
		}
		res.Clears++
		res.ClearedBlocks += int64(n)
	case p < 0.026:
		st := e.Stats()
		if st.Pool.Regions <= 1 {
			break
		}
		tr, err := e.Trim(ctx, 1+rng.Int64N(st.Pool.OwnedBytes/4+1))
		if err != nil {
			return fmt.Errorf("soak: trim: %w", err)
		}
		res.Trims++
		res.TrimmedBytes += tr.FreedBytes
	}
	if v := hostsim.InvariantViolations(e); len(v) > 0 {
		return fmt.Errorf("%d gating violations, first: %w", len(v), v[0])
	}
	return nil
}

func (r *soakResult) print(w io.Writer, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(r)
	}
	_, err := fmt.Fprintf(w, `soak: %.0f s on the %s backend, invariants %s
  engines opened and closed  %d
  requests                   %d
  ops                        %d (%d stores, %d loads, %d trims freeing %d bytes, %d deletes of %d blocks, %d clears of %d blocks)
  blocks verified            %d
  wrong blocks               %d
  failed copies              %d
  invariant violations       %d
  errors                     %d
`, r.Seconds, r.Backend, onOff(r.Invariants), r.Engines, r.Requests, r.Ops, r.StoreOps, r.LoadOps, r.Trims, r.TrimmedBytes,
		r.Deletes, r.DeletedBlocks, r.Clears, r.ClearedBlocks, r.BlocksVerified, r.VerifyFailures, r.FailedCopies, r.Violations, r.Errors)
	if err == nil && r.Interrupted {
		_, err = fmt.Fprintf(w, "  interrupted                before the end of --duration: this reports what ran\n")
	}
	if err == nil && r.FirstError != "" {
		_, err = fmt.Fprintf(w, "  first error                %s\n", r.FirstError)
	}
	return err
}

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off (build with -tags kvoinvariants)"
}
