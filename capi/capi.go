//go:build cgo

package main

/*
#include <stddef.h>
#include <stdint.h>

extern void kvoSetError(const char* msg, size_t n);
*/
import "C"

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"

	"github.com/kvoffload/kvoffload/offload"
	"github.com/kvoffload/kvoffload/offload/hostsim"
)

// Error codes; they match the KVO_* macros of kvoffload.h.
const (
	codeOK         = 0
	codeInval      = -1
	codeClosed     = -2
	codeBusy       = -3
	codeNoDriver   = -4
	codeNoMem      = -5
	codeReleased   = -6
	codeCapturing  = -7
	codeFail       = -8
	codeTimeout    = -9
	codeNotDone    = -11
	codeGrowth     = -12
	codeUnavail    = -13
	keyBytes       = 16
	maxBlocksInOne = 1 << 26 // keys per call: bounds the size computations below
)

// engineEntry is what an engine handle maps to. sim is the simulated GPU
// handed to the engine (used when the engine runs on the host backend),
// owned by the entry and closed after the engine.
type engineEntry struct {
	eng *offload.Engine
	sim *hostsim.GPU
}

var (
	engines = newRegistry[*engineEntry](kindEngine, "engine")
	ops     = newRegistry[*offload.Op](kindOp, "op")
	leases  = newRegistry[*offload.Lease](kindLease, "lease")
)

// fail sets the calling thread's last error to err's text and returns the
// error code for it.
func fail(err error) C.int {
	msg := []byte(err.Error())
	if len(msg) == 0 {
		msg = []byte("kvoffload: error")
	}
	C.kvoSetError((*C.char)(unsafe.Pointer(&msg[0])), C.size_t(len(msg)))
	return code(err)
}

// failCode is fail with the code given rather than the one err maps to.
func failCode(err error, c C.int) C.int {
	fail(err)
	return c
}

// failf is fail of an invalid-argument error made from format and args.
func failf(format string, args ...any) C.int {
	return fail(fmt.Errorf("%w: "+format, append([]any{offload.ErrInvalidArgument}, args...)...))
}

// code maps an error to its KVO_* code.
func code(err error) C.int {
	switch {
	case errors.Is(err, errStale):
		if errors.Is(err, errEngineStale) {
			return codeClosed
		}
		return codeReleased
	case errors.Is(err, errUnknown),
		errors.Is(err, offload.ErrInvalidArgument),
		errors.Is(err, offload.ErrInvalidConfig),
		errors.Is(err, offload.ErrPoolTooSmall):
		return codeInval
	case errors.Is(err, offload.ErrClosed):
		return codeClosed
	case errors.Is(err, offload.ErrBusy):
		return codeBusy
	case errors.Is(err, offload.ErrNoDriver):
		return codeNoDriver
	case errors.Is(err, offload.ErrInsufficientMemory):
		return codeNoMem
	case errors.Is(err, offload.ErrReleased):
		return codeReleased
	case errors.Is(err, offload.ErrCapturing):
		return codeCapturing
	case errors.Is(err, offload.ErrNotDone):
		return codeNotDone
	case errors.Is(err, offload.ErrUnavailable):
		return codeUnavail
	case errors.Is(err, context.DeadlineExceeded):
		return codeTimeout
	}
	return codeFail
}

// errEngineStale marks a destroyed engine's handle (KVO_ECLOSED rather than
// KVO_ERELEASED).
var errEngineStale = errors.New("engine destroyed")

// guard turns a panic into KVO_EFAIL; every export defers it.
func guard(rc *C.int) {
	if r := recover(); r != nil {
		*rc = fail(fmt.Errorf("kvoffload: internal error (panic): %v", r))
	}
}

func engine(h C.uint64_t) (*offload.Engine, error) {
	e, err := engineOf(h)
	if err != nil {
		return nil, err
	}
	return e.eng, nil
}

func engineOf(h C.uint64_t) (*engineEntry, error) {
	e, err := engines.get(uint64(h))
	if err != nil {
		if errors.Is(err, errStale) {
			return nil, fmt.Errorf("%w (%w): %w", offload.ErrClosed, errEngineStale, err)
		}
		return nil, err
	}
	return e, nil
}

// goKeys copies n packed 16-byte keys from C memory.
func goKeys(p *C.uint8_t, n C.size_t) ([]offload.Key, error) {
	if n > maxBlocksInOne {
		return nil, fmt.Errorf("%w: %d keys, more than %d in one call", offload.ErrInvalidArgument, uint64(n), maxBlocksInOne)
	}
	if n == 0 {
		return nil, nil
	}
	if p == nil {
		return nil, fmt.Errorf("%w: keys is NULL with n = %d", offload.ErrInvalidArgument, uint64(n))
	}
	raw := unsafe.Slice((*byte)(unsafe.Pointer(p)), int(n)*keyBytes)
	keys := make([]offload.Key, n)
	for i := range keys {
		copy(keys[i][:], raw[i*keyBytes:])
	}
	return keys, nil
}

// goBlockIDs copies n block ids from C memory.
func goBlockIDs(p *C.int64_t, n C.size_t) ([]int, error) {
	if n == 0 {
		return nil, nil
	}
	if p == nil {
		return nil, fmt.Errorf("%w: block_ids is NULL with n = %d", offload.ErrInvalidArgument, uint64(n))
	}
	raw := unsafe.Slice((*int64)(unsafe.Pointer(p)), int(n))
	ids := make([]int, n)
	for i, v := range raw {
		if v < 0 || v > math.MaxInt32 {
			return nil, fmt.Errorf("%w: block id %d (index %d) is negative or above %d", offload.ErrInvalidArgument, v, i, math.MaxInt32)
		}
		ids[i] = int(v)
	}
	return ids, nil
}

// writeJSON marshals v into buf as a NUL-terminated string; *needed gets
// the size with the NUL.
func writeJSON(v any, buf *C.char, capacity C.size_t, needed *C.size_t) C.int {
	b, err := json.Marshal(v)
	if err != nil {
		return fail(fmt.Errorf("kvoffload: encoding JSON: %w", err))
	}
	if needed != nil {
		*needed = C.size_t(len(b) + 1)
	}
	if buf == nil || uint64(capacity) < uint64(len(b)+1) {
		return failf("buffer of %d bytes, the JSON needs %d", uint64(capacity), len(b)+1)
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buf)), len(b)+1)
	copy(out, b)
	out[len(b)] = 0
	return codeOK
}

// timeoutCtx is a context ending after ns nanoseconds (never when ns < 0).
func timeoutCtx(ns C.int64_t) (context.Context, context.CancelFunc) {
	if ns < 0 {
		return context.WithCancel(context.Background())
	}
	return context.WithTimeout(context.Background(), time.Duration(ns))
}

// configJSON is what kvo_engine_config_json writes: the engine's Config
// with the backend in use in place of the configured one ("auto" resolved)
// and the device always present (Config drops a zero device).
type configJSON struct {
	offload.Config
	Backend offload.Backend `json:"backend"`
	Device  int             `json:"device"`
}

//export kvoGo_engine_config_json
func kvoGo_engine_config_json(h C.uint64_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	cfg := eng.Config()
	backend, _ := eng.Backend()
	return writeJSON(configJSON{Config: cfg, Backend: backend, Device: cfg.Device}, buf, capacity, needed)
}

//export kvoGo_lookup
func kvoGo_lookup(h C.uint64_t, keysP *C.uint8_t, n C.size_t, lease C.int, hits *C.size_t, leaseOut *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if hits == nil || (lease != 0 && leaseOut == nil) {
		return failf("kvo_lookup: hits (and lease_out when lease is set) must not be NULL")
	}
	eng, keys, err := engineKeys(h, keysP, n)
	if err != nil {
		return fail(err)
	}
	res, err := eng.Lookup(keys, offload.LookupOptions{Lease: lease != 0})
	if err != nil {
		return fail(err)
	}
	*hits = C.size_t(res.Hits)
	if lease != 0 {
		*leaseOut = 0
		if res.Lease != nil {
			*leaseOut = C.uint64_t(leases.add(res.Lease))
		}
	}
	return codeOK
}

// engineKeys is the engine of handle h and the n keys at keysP.
func engineKeys(h C.uint64_t, keysP *C.uint8_t, n C.size_t) (*offload.Engine, []offload.Key, error) {
	eng, err := engine(h)
	if err != nil {
		return nil, nil, err
	}
	keys, err := goKeys(keysP, n)
	if err != nil {
		return nil, nil, err
	}
	return eng, keys, nil
}

// opArgs checks and converts the arguments kvo_store and kvo_load share:
// the op out-pointer, the engine handle, and the n keys and block ids.
func opArgs(fn string, h C.uint64_t, keysP *C.uint8_t, idsP *C.int64_t, n C.size_t, opOut *C.uint64_t) (*offload.Engine, []offload.Key, []int, error) {
	if opOut == nil {
		return nil, nil, nil, fmt.Errorf("%w: %s: op must not be NULL", offload.ErrInvalidArgument, fn)
	}
	eng, keys, err := engineKeys(h, keysP, n)
	if err != nil {
		return nil, nil, nil, err
	}
	ids, err := goBlockIDs(idsP, n)
	if err != nil {
		return nil, nil, nil, err
	}
	return eng, keys, ids, nil
}

// storeParents converts kvo_store's parent (one key or NULL) and parents
// (n keys or NULL) into StoreOptions.Parent and Parents; at most one of
// them may be given.
func storeParents(parentP, parentsP *C.uint8_t, n C.size_t) (offload.Key, []offload.Key, error) {
	var parent offload.Key
	if parentP != nil && parentsP != nil {
		return parent, nil, fmt.Errorf("%w: kvo_store: parent and parents both given; parents names every key's parent, pass NULL for parent", offload.ErrInvalidArgument)
	}
	if parentP != nil {
		copy(parent[:], unsafe.Slice((*byte)(unsafe.Pointer(parentP)), keyBytes))
		return parent, nil, nil
	}
	if parentsP == nil {
		return parent, nil, nil
	}
	parents, err := goKeys(parentsP, n)
	if err != nil {
		return parent, nil, err
	}
	if parents == nil {
		parents = []offload.Key{} // n = 0: given, and empty
	}
	return parent, parents, nil
}

//export kvoGo_store
func kvoGo_store(h C.uint64_t, keysP *C.uint8_t, idsP *C.int64_t, n C.size_t, parentP, parentsP *C.uint8_t, afterEvent, afterStream C.uintptr_t, opOut *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	eng, keys, ids, err := opArgs("kvo_store", h, keysP, idsP, n, opOut)
	if err != nil {
		return fail(err)
	}
	parent, parents, err := storeParents(parentP, parentsP, n)
	if err != nil {
		return fail(err)
	}
	op, err := eng.Store(context.Background(), keys, ids, offload.StoreOptions{After: uintptr(afterEvent), AfterStream: uintptr(afterStream), Parent: parent, Parents: parents})
	if err != nil {
		return fail(err)
	}
	*opOut = C.uint64_t(ops.add(op))
	return codeOK
}

//export kvoGo_load
func kvoGo_load(h C.uint64_t, keysP *C.uint8_t, idsP *C.int64_t, n C.size_t, leaseH C.uint64_t, afterEvent C.uintptr_t, perLayer C.int, signal C.uintptr_t, opOut *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	eng, keys, ids, err := opArgs("kvo_load", h, keysP, idsP, n, opOut)
	if err != nil {
		return fail(err)
	}
	opts := offload.LoadOptions{After: uintptr(afterEvent), PerLayer: perLayer != 0, Signal: uintptr(signal)}
	if leaseH != 0 {
		// Taken out of the table first so that a concurrent kvo_lease_release
		// cannot release it under the load; put back if the load fails.
		if opts.Lease, err = leases.take(uint64(leaseH)); err != nil {
			return fail(err)
		}
	}
	op, err := eng.Load(context.Background(), keys, ids, opts)
	if err != nil {
		if opts.Lease != nil {
			leases.restore(uint64(leaseH), opts.Lease)
		}
		return fail(err)
	}
	*opOut = C.uint64_t(ops.add(op))
	return codeOK
}

//export kvoGo_op_wait
func kvoGo_op_wait(h C.uint64_t, timeoutNS C.int64_t) (rc C.int) {
	defer guard(&rc)
	op, err := ops.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	select {
	case <-op.Done():
	default:
		if timeoutNS == 0 {
			return fail(fmt.Errorf("kvo_op_wait: %s of %d blocks not done: %w", op.Kind(), op.Len(), context.DeadlineExceeded))
		}
		ctx, cancel := timeoutCtx(timeoutNS)
		defer cancel()
		select {
		case <-op.Done():
		case <-ctx.Done():
			return fail(fmt.Errorf("kvo_op_wait: %s of %d blocks not done after %v: %w", op.Kind(), op.Len(), time.Duration(timeoutNS), context.DeadlineExceeded))
		}
	}
	if err := op.Err(); err != nil {
		return fail(fmt.Errorf("kvoffload: %s failed: %w", op.Kind(), err))
	}
	return codeOK
}

//export kvoGo_op_query
func kvoGo_op_query(h C.uint64_t, done *C.int) (rc C.int) {
	defer guard(&rc)
	if done == nil {
		return failf("kvo_op_query: done must not be NULL")
	}
	op, err := ops.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	select {
	case <-op.Done():
		*done = 1
	default:
		*done = 0
	}
	return codeOK
}

//export kvoGo_op_stream_wait
func kvoGo_op_stream_wait(h C.uint64_t, stream C.uintptr_t) (rc C.int) {
	defer guard(&rc)
	op, err := ops.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if err := op.StreamWait(uintptr(stream)); err != nil {
		return fail(err)
	}
	return codeOK
}

//export kvoGo_op_event
func kvoGo_op_event(h C.uint64_t, event *C.uintptr_t) (rc C.int) {
	defer guard(&rc)
	return opEvent(h, event, "kvo_op_event", (*offload.Op).Event)
}

//export kvoGo_op_layer_event
func kvoGo_op_layer_event(h C.uint64_t, layer C.int, event *C.uintptr_t) (rc C.int) {
	defer guard(&rc)
	return opEvent(h, event, "kvo_op_layer_event", func(op *offload.Op) (uintptr, error) { return op.LayerEvent(int(layer)) })
}

// opEvent is kvo_op_event and kvo_op_layer_event: *event gets the CUevent
// get returns for op h.
func opEvent(h C.uint64_t, event *C.uintptr_t, call string, get func(*offload.Op) (uintptr, error)) C.int {
	if event == nil {
		return failf("%s: event must not be NULL", call)
	}
	op, err := ops.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	ev, err := get(op)
	if err != nil {
		return fail(err)
	}
	*event = C.uintptr_t(ev)
	return codeOK
}

//export kvoGo_op_outcomes
func kvoGo_op_outcomes(h C.uint64_t, out *C.uint8_t, n C.size_t) (rc C.int) {
	defer guard(&rc)
	op, err := ops.get(uint64(h))
	if err != nil {
		return fail(err)
	}
	if uint64(n) != uint64(op.Len()) {
		return failf("kvo_op_outcomes: n = %d but the op has %d blocks", uint64(n), op.Len())
	}
	res, err := op.Outcomes()
	if err != nil {
		return fail(err)
	}
	if len(res) == 0 {
		return codeOK
	}
	if out == nil {
		return failf("kvo_op_outcomes: out must not be NULL")
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(out)), len(res))
	for i, oc := range res {
		dst[i] = byte(oc)
	}
	return codeOK
}

//export kvoGo_op_release
func kvoGo_op_release(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	return release(ops, h)
}

//export kvoGo_lease_release
func kvoGo_lease_release(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	return release(leases, h)
}

// release takes handle h out of r and releases what it names.
func release[T interface{ Release() error }](r *registry[T], h C.uint64_t) C.int {
	v, err := r.take(uint64(h))
	if err != nil {
		return fail(err)
	}
	if err := v.Release(); err != nil {
		return fail(err)
	}
	return codeOK
}

//export kvoGo_staging
func kvoGo_staging(h C.uint64_t, name *C.char, size C.uint64_t, ptr *C.uintptr_t, devPtr *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if name == nil || ptr == nil {
		return failf("kvo_staging: name and ptr must not be NULL")
	}
	if uint64(size) > math.MaxInt64 {
		return failf("kvo_staging: %d bytes is above %d", uint64(size), int64(math.MaxInt64))
	}
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	s, err := eng.Staging(C.GoString(name), int64(size))
	if err != nil {
		return fail(err)
	}
	*ptr = C.uintptr_t(s.Addr())
	if devPtr != nil {
		*devPtr = C.uint64_t(s.DevicePtr())
	}
	return codeOK
}

// statsJSON is what kvo_stats_json writes: the engine's Stats and, from
// the library, why the backend was picked and the Go runtime's GOMAXPROCS.
type statsJSON struct {
	offload.Stats
	BackendReason string `json:"backend_reason"`
	GoMaxProcs    int    `json:"go_maxprocs"`
}

//export kvoGo_stats_json
func kvoGo_stats_json(h C.uint64_t, buf *C.char, capacity C.size_t, needed *C.size_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	_, reason := eng.Backend()
	return writeJSON(statsJSON{Stats: eng.Stats(), BackendReason: reason, GoMaxProcs: runtime.GOMAXPROCS(0)}, buf, capacity, needed)
}

//export kvoGo_trim
func kvoGo_trim(h C.uint64_t, size C.uint64_t, timeoutNS C.int64_t, freed, pending *C.uint64_t) (rc C.int) {
	defer guard(&rc)
	if uint64(size) > math.MaxInt64 {
		return failf("kvo_trim: %d bytes is above %d", uint64(size), int64(math.MaxInt64))
	}
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	ctx, cancel := timeoutCtx(timeoutNS)
	defer cancel()
	res, err := eng.Trim(ctx, int64(size))
	if err != nil {
		return fail(err)
	}
	if freed != nil {
		*freed = C.uint64_t(res.FreedBytes)
	}
	if pending != nil {
		*pending = C.uint64_t(res.PendingBytes)
	}
	return codeOK
}

//export kvoGo_delete
func kvoGo_delete(h C.uint64_t, keysP *C.uint8_t, n C.size_t, deleted *C.size_t) (rc C.int) {
	defer guard(&rc)
	eng, keys, err := engineKeys(h, keysP, n)
	if err != nil {
		return fail(err)
	}
	k, err := eng.Delete(keys)
	if err != nil {
		return fail(err)
	}
	if deleted != nil {
		*deleted = C.size_t(k)
	}
	return codeOK
}

//export kvoGo_clear
func kvoGo_clear(h C.uint64_t, namespace *C.char, cleared *C.size_t) (rc C.int) {
	defer guard(&rc)
	if namespace == nil {
		return failf("kvo_clear: namespace must not be NULL (\"\" is the default namespace)")
	}
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	k, err := eng.Clear(C.GoString(namespace))
	if err != nil {
		return fail(err)
	}
	if cleared != nil {
		*cleared = C.size_t(k)
	}
	return codeOK
}

//export kvoGo_chain_keys
func kvoGo_chain_keys(ns *C.uint8_t, nsLen C.size_t, parentP *C.uint8_t, tokensP *C.uint32_t, nTokens, perBlock C.size_t, out *C.uint8_t, outCap C.size_t, nKeys *C.size_t) (rc C.int) {
	defer guard(&rc)
	if nKeys == nil {
		return failf("kvo_chain_keys: n_keys must not be NULL")
	}
	if perBlock == 0 || perBlock > math.MaxInt32 {
		return failf("kvo_chain_keys: tokens_per_block = %d, must be in [1, %d]", uint64(perBlock), math.MaxInt32)
	}
	if nTokens > math.MaxInt32 || nsLen > math.MaxInt32 {
		return failf("kvo_chain_keys: %d tokens or a namespace of %d bytes is above %d", uint64(nTokens), uint64(nsLen), math.MaxInt32)
	}
	if (nTokens > 0 && tokensP == nil) || (nsLen > 0 && ns == nil) {
		return failf("kvo_chain_keys: tokens or namespace is NULL with a non-zero length")
	}
	want := nTokens / perBlock
	*nKeys = want
	if want > outCap || (want > 0 && out == nil) {
		return failf("kvo_chain_keys: %d keys do not fit in out_cap = %d", uint64(want), uint64(outCap))
	}
	var parent offload.Key
	if parentP != nil {
		copy(parent[:], unsafe.Slice((*byte)(unsafe.Pointer(parentP)), keyBytes))
	}
	var tokens []uint32
	if nTokens > 0 {
		tokens = unsafe.Slice((*uint32)(unsafe.Pointer(tokensP)), int(nTokens))
	}
	var namespace string
	if nsLen > 0 {
		namespace = string(unsafe.Slice((*byte)(unsafe.Pointer(ns)), int(nsLen)))
	}
	keys, err := offload.ChainKeys(namespace, parent, tokens, int(perBlock))
	if err != nil {
		return fail(err)
	}
	if len(keys) == 0 {
		return codeOK
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(out)), len(keys)*keyBytes)
	for i, k := range keys {
		copy(dst[i*keyBytes:], k[:])
	}
	return codeOK
}

// simMemory returns the engine's simulated GPU, refusing the CUDA backend.
func simMemory(h C.uint64_t, call string) (*hostsim.GPU, error) {
	e, err := engineOf(h)
	if err != nil {
		return nil, err
	}
	if name, _ := e.eng.Backend(); name != offload.BackendHost {
		return nil, fmt.Errorf("%w: %s: the engine's backend is %q; simulated GPU memory exists only on %q", offload.ErrInvalidArgument, call, name, offload.BackendHost)
	}
	return e.sim, nil
}

//export kvoGo_sim_write
func kvoGo_sim_write(h C.uint64_t, addr C.uint64_t, src unsafe.Pointer, n C.size_t) (rc C.int) {
	defer guard(&rc)
	return simCopy(h, addr, src, n, "kvo_sim_write", "src", (*hostsim.GPU).Write)
}

//export kvoGo_sim_read
func kvoGo_sim_read(h C.uint64_t, addr C.uint64_t, dst unsafe.Pointer, n C.size_t) (rc C.int) {
	defer guard(&rc)
	return simCopy(h, addr, dst, n, "kvo_sim_read", "dst", (*hostsim.GPU).Read)
}

// simCopy is kvo_sim_write and kvo_sim_read: move copies n bytes between
// the caller's buffer p (named arg in errors) and simulated memory at addr.
func simCopy(h, addr C.uint64_t, p unsafe.Pointer, n C.size_t, call, arg string, move func(*hostsim.GPU, uint64, []byte) error) C.int {
	if p == nil && n > 0 {
		return failf("%s: %s is NULL with n = %d", call, arg, uint64(n))
	}
	// Checked before unsafe.Slice, which panics on a length above MaxInt or
	// a buffer wrapping the address space.
	if uint64(n) > math.MaxInt64 {
		return failf("%s: n = %d bytes is above %d", call, uint64(n), int64(math.MaxInt64))
	}
	if end := uintptr(p) + uintptr(n); end < uintptr(p) {
		return failf("%s: %s at %#x with n = %d bytes wraps the address space (at most %d bytes there)", call, arg, uintptr(p), uint64(n), ^uintptr(0)-uintptr(p)+1)
	}
	sim, err := simMemory(h, call)
	if err != nil {
		return fail(err)
	}
	if n == 0 {
		return codeOK
	}
	if err := move(sim, uint64(addr), unsafe.Slice((*byte)(p), int(n))); err != nil {
		return fail(fmt.Errorf("%w: %s: %w", offload.ErrInvalidArgument, call, err))
	}
	return codeOK
}

//export kvoGo_wait_grown
func kvoGo_wait_grown(h C.uint64_t, timeoutNS C.int64_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	ctx, cancel := timeoutCtx(timeoutNS)
	defer cancel()
	err = eng.WaitGrown(ctx)
	if err == nil {
		return codeOK
	}
	return failCode(err, growthCode(err, eng.Stats().Pool.GrowthError != ""))
}

// growthCode is kvo_wait_grown's code for WaitGrown's error err, where
// growthFailed tells whether background growth stopped on an error of its
// own (Stats.Pool.GrowthError): that error is KVO_EGROWTH whatever it wraps (an
// mlock refused, ENOMEM, a driver error), so that a caller tells it from
// a timeout (KVO_ETIMEOUT) and from Close (KVO_ECLOSED).
func growthCode(err error, growthFailed bool) C.int {
	switch {
	case err == nil:
		return codeOK
	case growthFailed:
		return codeGrowth
	case errors.Is(err, offload.ErrClosed):
		return codeClosed
	case errors.Is(err, context.DeadlineExceeded):
		return codeTimeout
	}
	return codeFail
}

//export kvoGo_pause_growth
func kvoGo_pause_growth(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	eng.PauseGrowth()
	return codeOK
}

//export kvoGo_resume_growth
func kvoGo_resume_growth(h C.uint64_t) (rc C.int) {
	defer guard(&rc)
	eng, err := engine(h)
	if err != nil {
		return fail(err)
	}
	eng.ResumeGrowth()
	return codeOK
}
