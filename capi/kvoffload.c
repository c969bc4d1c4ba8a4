//go:build cgo

// The public entry points of libkvoffload.so (declared in kvoffload.h).
// Each one refuses a forked child before any Go code runs, clears the
// calling thread's last error, and calls the Go implementation kvoGo_*.
// The per-thread last error lives here, in C thread-local storage.

#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "kvoffload.h"
#include "_cgo_export.h"

#define KVO_ERR_CAP 1024

static __thread char kvo_err[KVO_ERR_CAP];
static pid_t kvo_pid;

// Runs when the library is loaded: the pid every call is checked against.
__attribute__((constructor)) static void kvo_record_pid(void) { kvo_pid = getpid(); }

// kvoSetError is called by Go (on the calling thread) to set the last error.
void kvoSetError(const char* msg, size_t n) {
	if (n >= KVO_ERR_CAP) {
		n = KVO_ERR_CAP - 1;
	}
	memcpy(kvo_err, msg, n);
	kvo_err[n] = '\0';
}

const char* kvo_last_error(void) { return kvo_err; }

// The release version, from Go once (the first call waits for the Go
// runtime's start like any call into Go), then from this pointer: a forked
// child that asks first gets "" rather than a call into a dead runtime.
static const char* kvo_version_str;

const char* kvo_version(void) {
	const char* v = __atomic_load_n(&kvo_version_str, __ATOMIC_ACQUIRE);
	if (v == NULL && getpid() == kvo_pid) {
		v = kvoGo_version();
		__atomic_store_n(&kvo_version_str, v, __ATOMIC_RELEASE);
	}
	return v != NULL ? v : "";
}

int kvo_abi_version(void) { return KVO_ABI_VERSION; }

// enter clears the last error and refuses a forked child.
static int enter(void) {
	kvo_err[0] = '\0';
	pid_t now = getpid();
	if (now != kvo_pid) {
		snprintf(kvo_err, KVO_ERR_CAP,
		         "kvoffload: called in process %d, a fork of process %d that loaded the library; "
		         "the Go runtime does not survive fork: create engines in the parent, or start "
		         "the child with spawn/exec and load the library there",
		         (int)now, (int)kvo_pid);
		return KVO_EFORK;
	}
	return KVO_OK;
}

#define ENTER()                    \
	do {                           \
		int rc_ = enter();         \
		if (rc_ != KVO_OK) {       \
			return rc_;            \
		}                          \
	} while (0)

int kvo_engine_create(const char* config_json, kvo_engine_t* out) {
	ENTER();
	return kvoGo_engine_create((char*)config_json, out);
}

int kvo_engine_connect(const char* socket, const char* config_json, kvo_engine_t* out) {
	ENTER();
	return kvoGo_engine_connect((char*)socket, (char*)config_json, out);
}

int kvo_engine_destroy(kvo_engine_t engine) {
	ENTER();
	return kvoGo_engine_destroy(engine);
}

int kvo_engine_config_json(kvo_engine_t engine, char* buf, size_t cap, size_t* needed) {
	ENTER();
	return kvoGo_engine_config_json(engine, buf, cap, needed);
}

int kvo_lookup(kvo_engine_t engine, const uint8_t* keys, size_t n, int lease, size_t* hits,
               kvo_lease_t* lease_out) {
	ENTER();
	return kvoGo_lookup(engine, (uint8_t*)keys, n, lease, hits, lease_out);
}

int kvo_store(kvo_engine_t engine, const uint8_t* keys, const int64_t* block_ids, size_t n,
              const uint8_t* parent, const uint8_t* parents, uintptr_t after_event,
              uintptr_t after_stream, kvo_op_t* op) {
	ENTER();
	return kvoGo_store(engine, (uint8_t*)keys, (int64_t*)block_ids, n, (uint8_t*)parent,
	                   (uint8_t*)parents, after_event, after_stream, op);
}

int kvo_load(kvo_engine_t engine, const uint8_t* keys, const int64_t* block_ids, size_t n,
             kvo_lease_t lease, uintptr_t after_event, int per_layer, uintptr_t signal_event,
             kvo_op_t* op) {
	ENTER();
	return kvoGo_load(engine, (uint8_t*)keys, (int64_t*)block_ids, n, lease, after_event, per_layer,
	                  signal_event, op);
}

int kvo_op_wait(kvo_op_t op, int64_t timeout_ns) {
	ENTER();
	return kvoGo_op_wait(op, timeout_ns);
}

int kvo_op_query(kvo_op_t op, int* done) {
	ENTER();
	return kvoGo_op_query(op, done);
}

int kvo_op_stream_wait(kvo_op_t op, uintptr_t stream) {
	ENTER();
	return kvoGo_op_stream_wait(op, stream);
}

int kvo_op_event(kvo_op_t op, uintptr_t* event) {
	ENTER();
	return kvoGo_op_event(op, event);
}

int kvo_op_layer_event(kvo_op_t op, int layer, uintptr_t* event) {
	ENTER();
	return kvoGo_op_layer_event(op, layer, event);
}

int kvo_op_outcomes(kvo_op_t op, uint8_t* out, size_t n) {
	ENTER();
	return kvoGo_op_outcomes(op, out, n);
}

int kvo_op_release(kvo_op_t op) {
	ENTER();
	return kvoGo_op_release(op);
}

int kvo_lease_release(kvo_lease_t lease) {
	ENTER();
	return kvoGo_lease_release(lease);
}

int kvo_staging(kvo_engine_t engine, const char* name, uint64_t bytes, void** ptr,
                uint64_t* device_ptr) {
	ENTER();
	return kvoGo_staging(engine, (char*)name, bytes, (uintptr_t*)ptr, device_ptr);
}

int kvo_stats_json(kvo_engine_t engine, char* buf, size_t cap, size_t* needed) {
	ENTER();
	return kvoGo_stats_json(engine, buf, cap, needed);
}

int kvo_trim(kvo_engine_t engine, uint64_t bytes, int64_t timeout_ns, uint64_t* freed_bytes,
             uint64_t* pending_bytes) {
	ENTER();
	return kvoGo_trim(engine, bytes, timeout_ns, freed_bytes, pending_bytes);
}

int kvo_delete(kvo_engine_t engine, const uint8_t* keys, size_t n, size_t* deleted) {
	ENTER();
	return kvoGo_delete(engine, (uint8_t*)keys, n, deleted);
}

int kvo_clear(kvo_engine_t engine, const char* namespace_, size_t* cleared) {
	ENTER();
	return kvoGo_clear(engine, (char*)namespace_, cleared);
}

int kvo_chain_keys(const uint8_t* namespace_, size_t namespace_len, const uint8_t* parent,
                   const uint32_t* tokens, size_t n_tokens, size_t tokens_per_block, uint8_t* out,
                   size_t out_cap, size_t* n_keys) {
	ENTER();
	return kvoGo_chain_keys((uint8_t*)namespace_, namespace_len, (uint8_t*)parent, (uint32_t*)tokens,
	                        n_tokens, tokens_per_block, out, out_cap, n_keys);
}

int kvo_sim_write(kvo_engine_t engine, uint64_t device_addr, const void* src, size_t n) {
	ENTER();
	return kvoGo_sim_write(engine, device_addr, (void*)src, n);
}

int kvo_sim_read(kvo_engine_t engine, uint64_t device_addr, void* dst, size_t n) {
	ENTER();
	return kvoGo_sim_read(engine, device_addr, dst, n);
}

int kvo_wait_grown(kvo_engine_t engine, int64_t timeout_ns) {
	ENTER();
	return kvoGo_wait_grown(engine, timeout_ns);
}

int kvo_pause_growth(kvo_engine_t engine) {
	ENTER();
	return kvoGo_pause_growth(engine);
}

int kvo_resume_growth(kvo_engine_t engine) {
	ENTER();
	return kvoGo_resume_growth(engine);
}

int kvo_metrics_text(kvo_engine_t engine, char* buf, size_t cap, size_t* needed) {
	ENTER();
	return kvoGo_metrics_text(engine, buf, cap, needed);
}

int kvo_events_open(kvo_engine_t engine, int64_t buffer) {
	ENTER();
	return kvoGo_events_open(engine, buffer);
}

int kvo_events_poll(kvo_engine_t engine, char* buf, size_t cap, size_t* needed) {
	ENTER();
	return kvoGo_events_poll(engine, buf, cap, needed);
}

int kvo_events_dropped(kvo_engine_t engine, uint64_t* dropped) {
	ENTER();
	return kvoGo_events_dropped(engine, dropped);
}

int kvo_events_close(kvo_engine_t engine) {
	ENTER();
	return kvoGo_events_close(engine);
}

int kvo_store_tokens(kvo_engine_t engine, const uint8_t* keys, const int64_t* block_ids, size_t n,
                     const uint8_t* parent, const uint8_t* parents, const uint32_t* tokens,
                     size_t n_tokens, uintptr_t after_event, uintptr_t after_stream, kvo_op_t* op_out) {
	ENTER();
	return kvoGo_store_tokens(engine, (uint8_t*)keys, (int64_t*)block_ids, n, (uint8_t*)parent,
	                          (uint8_t*)parents, (uint32_t*)tokens, n_tokens, after_event, after_stream,
	                          op_out);
}

int kvo_prefetch(kvo_engine_t engine, const uint8_t* keys, size_t n, int64_t timeout_ns,
                 size_t* promoted, size_t* from_disk, size_t* from_cluster) {
	ENTER();
	return kvoGo_prefetch(engine, (uint8_t*)keys, n, timeout_ns, promoted, from_disk, from_cluster);
}

int kvo_prefetch_background(kvo_engine_t engine, const uint8_t* keys, size_t n, int64_t timeout_ns,
                            int* started) {
	ENTER();
	return kvoGo_prefetch_background(engine, (uint8_t*)keys, n, timeout_ns, started);
}
