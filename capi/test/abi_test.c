// abi_test exercises libkvoffload.so through kvoffload.h on the host
// backend: create, store (with parent and parents), lookup, lease, load,
// outcomes, stats, staging, trim, delete, clear, errors, stale handles
// (codes per kind), concurrent calls from several pthreads, the per-thread
// last error, and the refusal in a forked child.
// It is built and run by capi's Go test (TestABI); it prints what failed and
// exits non-zero on the first failure.

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvoffload.h"

#define CHECK(cond, ...)                                                        \
	do {                                                                        \
		if (!(cond)) {                                                          \
			fprintf(stderr, "%s:%d: check failed: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                       \
			fprintf(stderr, " (last error: %s)\n", kvo_last_error());           \
			exit(1);                                                            \
		}                                                                       \
	} while (0)

#define OK(call) CHECK((call) == KVO_OK, "%s", #call)
#define FAILS(call, code)                                                       \
	do {                                                                        \
		int rc_ = (call);                                                       \
		CHECK(rc_ == (code), "%s returned %d, want %d", #call, rc_, code);      \
		CHECK(kvo_last_error()[0] != '\0', "%s set no error text", #call);      \
	} while (0)

enum { LAYERS = 2, HEADS = 2, DIM = 8, DTYPE = 2, TPB = 4, NUM_BLOCKS = 64 };
enum { SEG = TPB * HEADS * DIM * DTYPE }; // bytes of one K or V segment

static uint64_t k_addr[LAYERS], v_addr[LAYERS], stride[LAYERS];

static const char* config =
    "{\"pool_bytes\": 1048576, \"backend\": \"host\", \"staging_bytes\": 8192,"
    " \"skip_memory_check\": true, \"policy\": \"lru\", \"namespace\": \"abi-test\","
    " \"layout\": {\"kind\": \"layer-separate\", \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
    " \"dtype_bytes\": 2, \"tokens_per_block\": 4, \"num_blocks\": 64}}";

// parse_layout reads the simulated tensors' addresses from the engine's
// configuration JSON ({"k":..,"v":..,"stride":..} per layer).
static void parse_layout(kvo_engine_t e) {
	size_t need = 0;
	FAILS(kvo_engine_config_json(e, NULL, 0, &need), KVO_EINVAL);
	CHECK(need > 1, "needed %zu", need);
	char* buf = malloc(need);
	OK(kvo_engine_config_json(e, buf, need, &need));
	CHECK(strlen(buf) + 1 == need, "length %zu, needed %zu", strlen(buf), need);
	CHECK(strstr(buf, "\"backend\":\"host\"") != NULL, "no backend in %s", buf);
	CHECK(strstr(buf, "\"device\":0") != NULL, "no device 0 in %s", buf);
	const char* p = strstr(buf, "\"layer_tensors\":[");
	CHECK(p != NULL, "no layer_tensors in %s", buf);
	p += strlen("\"layer_tensors\":[");
	for (int l = 0; l < LAYERS; l++) {
		unsigned long long k, v, s;
		CHECK(sscanf(p, "{\"k\":%llu,\"v\":%llu,\"stride\":%llu}", &k, &v, &s) == 3, "layer %d in %s", l, p);
		k_addr[l] = k, v_addr[l] = v, stride[l] = s;
		p = strchr(p, '}') + 2;
	}
	free(buf);
}

static uint8_t pattern(int block, int seg, int i, int salt) { return (uint8_t)(block * 31 + seg * 7 + i + salt); }

// write_block fills GPU block b with its pattern; read_block checks block
// b holds block src's pattern.
static void write_block(kvo_engine_t e, int b, int salt) {
	uint8_t seg[SEG];
	for (int l = 0; l < LAYERS; l++) {
		for (int kv = 0; kv < 2; kv++) {
			for (int i = 0; i < SEG; i++) seg[i] = pattern(b, 2 * l + kv, i, salt);
			OK(kvo_sim_write(e, (kv ? v_addr[l] : k_addr[l]) + (uint64_t)b * stride[l], seg, SEG));
		}
	}
}

static int block_matches(kvo_engine_t e, int b, int src, int salt) {
	uint8_t seg[SEG];
	for (int l = 0; l < LAYERS; l++) {
		for (int kv = 0; kv < 2; kv++) {
			OK(kvo_sim_read(e, (kv ? v_addr[l] : k_addr[l]) + (uint64_t)b * stride[l], seg, SEG));
			for (int i = 0; i < SEG; i++) {
				if (seg[i] != pattern(src, 2 * l + kv, i, salt)) return 0;
			}
		}
	}
	return 1;
}

static void make_key(uint8_t* key, int id, int salt) {
	memset(key, 0, KVO_KEY_BYTES);
	memcpy(key, &id, sizeof id);
	memcpy(key + 8, &salt, sizeof salt);
	key[15] = 0xab;
}

static void check_outcomes(kvo_op_t op, size_t n, uint8_t want) {
	uint8_t out[NUM_BLOCKS];
	OK(kvo_op_outcomes(op, out, n));
	for (size_t i = 0; i < n; i++) CHECK(out[i] == want, "block %zu outcome %d, want %d", i, out[i], want);
}

static void test_chain_keys(void) {
	uint32_t tokens[20];
	for (int i = 0; i < 20; i++) tokens[i] = (uint32_t)i;
	uint8_t out[2 * KVO_KEY_BYTES];
	size_t n = 0;
	OK(kvo_chain_keys(NULL, 0, NULL, tokens, 20, 16, out, 2, &n));
	CHECK(n == 1, "n = %zu", n);
	static const uint8_t want[16] = {0x41, 0xf3, 0x72, 0x73, 0xf5, 0xdc, 0xb9, 0xd4,
	                                 0x17, 0xf8, 0x54, 0x1c, 0x20, 0xd3, 0x82, 0xed};
	CHECK(memcmp(out, want, 16) == 0, "key of tokens 0..15 differs from the committed vector");
	FAILS(kvo_chain_keys(NULL, 0, NULL, tokens, 20, 0, out, 2, &n), KVO_EINVAL);
	FAILS(kvo_chain_keys(NULL, 0, NULL, tokens, 20, 4, out, 2, &n), KVO_EINVAL);
	CHECK(n == 5, "needed %zu keys, want 5", n);
}

static void test_round_trip(kvo_engine_t e) {
	enum { N = 8 };
	uint8_t keys[N * KVO_KEY_BYTES];
	int64_t src[N], dst[N];
	for (int i = 0; i < N; i++) {
		make_key(keys + i * KVO_KEY_BYTES, i, 0);
		src[i] = i;
		dst[i] = N + i;
		write_block(e, i, 0);
	}
	kvo_op_t op = 0;
	OK(kvo_store(e, keys, src, N, NULL, NULL, 0, 0, &op));
	CHECK(op != 0, "op handle 0");
	OK(kvo_op_wait(op, -1));
	int done = 0;
	OK(kvo_op_query(op, &done));
	CHECK(done == 1, "done = %d after wait", done);
	check_outcomes(op, N, KVO_OUTCOME_STORED);
	uintptr_t ev = 1;
	OK(kvo_op_event(op, &ev));
	CHECK(ev == 0, "host backend event %" PRIuPTR, ev);
	OK(kvo_op_stream_wait(op, 0));
	OK(kvo_op_release(op));
	FAILS(kvo_op_release(op), KVO_ERELEASED);
	FAILS(kvo_op_wait(op, 0), KVO_ERELEASED);

	// The same keys again: already present.
	OK(kvo_store(e, keys, src, N, NULL, NULL, 0, 0, &op));
	OK(kvo_op_wait(op, -1));
	check_outcomes(op, N, KVO_OUTCOME_ALREADY_PRESENT);
	OK(kvo_op_release(op));

	size_t hits = 99;
	kvo_lease_t lease = 0;
	OK(kvo_lookup(e, keys, N, 0, &hits, NULL));
	CHECK(hits == N, "hits %zu", hits);
	OK(kvo_lookup(e, keys, N, 1, &hits, &lease));
	CHECK(hits == N && lease != 0, "hits %zu lease %" PRIu64, hits, lease);

	// Overwrite the source blocks, load into other ones under the lease.
	for (int i = 0; i < N; i++) write_block(e, i, 77);
	OK(kvo_load(e, keys, dst, N, lease, 0, 1, 0, &op));
	FAILS(kvo_lease_release(lease), KVO_ERELEASED); // taken over by the load
	OK(kvo_op_wait(op, -1));
	check_outcomes(op, N, KVO_OUTCOME_LOADED);
	OK(kvo_op_layer_event(op, 0, &ev));
	for (int i = 0; i < N; i++) CHECK(block_matches(e, N + i, i, 0), "loaded block %d differs from stored block %d", N + i, i);
	uint8_t out[N];
	FAILS(kvo_op_outcomes(op, out, N - 1), KVO_EINVAL);
	OK(kvo_op_release(op));

	// A lease released by its owner.
	OK(kvo_lookup(e, keys, N, 1, &hits, &lease));
	OK(kvo_lease_release(lease));
	FAILS(kvo_lease_release(lease), KVO_ERELEASED);

	// Missing keys load as missing.
	uint8_t other[KVO_KEY_BYTES];
	make_key(other, 1000, 5);
	int64_t one = 40;
	OK(kvo_load(e, other, &one, 1, 0, 0, 0, 0, &op));
	OK(kvo_op_wait(op, -1));
	check_outcomes(op, 1, KVO_OUTCOME_MISSING);
	OK(kvo_op_release(op));

	size_t deleted = 0;
	OK(kvo_delete(e, keys, 2, &deleted));
	CHECK(deleted == 2, "deleted %zu", deleted);
	OK(kvo_lookup(e, keys, N, 0, &hits, NULL));
	CHECK(hits == 0, "hits %zu after deleting the first key", hits);
	size_t cleared = 0;
	OK(kvo_clear(e, "abi-test", &cleared));
	CHECK(cleared == N - 2, "cleared %zu", cleared);
}

static void test_errors(kvo_engine_t e) {
	uint8_t keys[2 * KVO_KEY_BYTES];
	make_key(keys, 1, 9);
	make_key(keys + KVO_KEY_BYTES, 2, 9);
	int64_t bad[2] = {0, NUM_BLOCKS};
	int64_t dup[2] = {3, 3};
	int64_t neg[2] = {-1, 2};
	kvo_op_t op = 0;
	FAILS(kvo_store(e, keys, bad, 2, NULL, NULL, 0, 0, &op), KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "64") != NULL, "error does not name the limit: %s", kvo_last_error());
	FAILS(kvo_store(e, keys, dup, 2, NULL, NULL, 0, 0, &op), KVO_EINVAL);
	FAILS(kvo_store(e, keys, neg, 2, NULL, NULL, 0, 0, &op), KVO_EINVAL);
	FAILS(kvo_store(e, NULL, dup, 2, NULL, NULL, 0, 0, &op), KVO_EINVAL);
	FAILS(kvo_store(e, keys, dup, 2, NULL, NULL, 0, 0, NULL), KVO_EINVAL);
	FAILS(kvo_load(e, keys, bad, 2, 0, 0, 0, 0, &op), KVO_EINVAL);
	CHECK(op == 0, "op written on error");
	size_t hits;
	FAILS(kvo_lookup(e, keys, 2, 0, NULL, NULL), KVO_EINVAL);
	FAILS(kvo_lookup(0, keys, 2, 0, &hits, NULL), KVO_EINVAL);
	FAILS(kvo_lookup(e + 1000, keys, 2, 0, &hits, NULL), KVO_EINVAL);
	FAILS(kvo_op_wait(12345, 0), KVO_EINVAL);
	FAILS(kvo_op_release(e), KVO_EINVAL); // an engine handle is not an op handle
	FAILS(kvo_lease_release(42), KVO_EINVAL);
	FAILS(kvo_load(e, keys, dup, 2, 7, 0, 0, 0, &op), KVO_EINVAL); // not a lease handle
	kvo_engine_t e2 = 0;
	FAILS(kvo_engine_create("{", &e2), KVO_EINVAL);
	FAILS(kvo_engine_create("{\"pool_bytes\": 1, \"no_such_field\": 1}", &e2), KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "no_such_field") != NULL, "error does not name the field: %s", kvo_last_error());
	FAILS(kvo_engine_create("{\"pool_bytes\": -5}", &e2), KVO_EINVAL);
	FAILS(kvo_engine_create(NULL, &e2), KVO_EINVAL);
	CHECK(e2 == 0, "engine handle written on error");
	// kvo_engine_connect: no node at the socket (Go's tests dial a real one).
	FAILS(kvo_engine_connect(NULL, "{}", &e2), KVO_EINVAL);
	FAILS(kvo_engine_connect("/nonexistent/kvoffload-node.sock",
	                         "{\"backend\": \"host\", \"namespace\": \"abi\", \"layout\": {\"kind\": \"layer-separate\","
	                         " \"layers\": 1, \"kv_heads\": 1, \"head_dim\": 64, \"dtype_bytes\": 2,"
	                         " \"tokens_per_block\": 16, \"num_blocks\": 4}}",
	                         &e2),
	      KVO_EUNAVAILABLE);
	CHECK(e2 == 0, "engine handle written on error");
	// The CUDA backend without a GPU: KVO_ENODRIVER (on a GPU machine the
	// made-up tensor addresses are accepted at creation).
	int rc = kvo_engine_create("{\"pool_bytes\": 65536, \"backend\": \"cuda\", \"skip_memory_check\": true,"
	                           " \"layout\": {\"kind\": \"layer-separate\", \"layers\": 1, \"kv_heads\": 1,"
	                           " \"head_dim\": 8, \"dtype_bytes\": 2, \"tokens_per_block\": 4, \"num_blocks\": 4,"
	                           " \"layer_tensors\": [{\"k\": 4096, \"v\": 8192, \"stride\": 64}]}}",
	                           &e2);
	CHECK(rc == KVO_ENODRIVER || rc == KVO_OK, "cuda backend: rc %d", rc);
	if (rc == KVO_OK) OK(kvo_engine_destroy(e2));
	// A successful call clears the thread's last error.
	OK(kvo_lookup(e, keys, 2, 0, &hits, NULL));
	CHECK(kvo_last_error()[0] == '\0', "error not cleared: %s", kvo_last_error());
}

// test_bad_values: values the library used to take with the wrong code or
// truncated (issue 19): a NUMA node the machine lacks and a namespace with
// a NUL byte are KVO_EINVAL at creation; kvo_sim_read/kvo_sim_write with
// n above INT64_MAX or a buffer wrapping the address space are KVO_EINVAL
// (not a recovered panic, KVO_EFAIL); kvo_op_layer_event is KVO_EINVAL for a
// store, a load without per_layer and a layer outside the layout.
static void test_bad_values(kvo_engine_t e) {
	kvo_engine_t e2 = 0;
	FAILS(kvo_engine_create("{\"pool_bytes\": 1048576, \"backend\": \"host\", \"skip_memory_check\": true,"
	                        " \"numa_node\": \"99\", \"layout\": {\"kind\": \"layer-separate\", \"layers\": 2,"
	                        " \"kv_heads\": 2, \"head_dim\": 8, \"dtype_bytes\": 2, \"tokens_per_block\": 4,"
	                        " \"num_blocks\": 64}}",
	                        &e2),
	      KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "\"99\"") != NULL, "error does not name the node: %s", kvo_last_error());
	FAILS(kvo_engine_create("{\"pool_bytes\": 1048576, \"backend\": \"host\", \"skip_memory_check\": true,"
	                        " \"namespace\": \"ns\\u0000garbage\", \"layout\": {\"kind\": \"layer-separate\","
	                        " \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8, \"dtype_bytes\": 2,"
	                        " \"tokens_per_block\": 4, \"num_blocks\": 64}}",
	                        &e2),
	      KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "NUL") != NULL, "error does not say NUL: %s", kvo_last_error());
	CHECK(e2 == 0, "engine handle written on error");

	uint8_t buf[16];
	FAILS(kvo_sim_read(e, k_addr[0], buf, SIZE_MAX), KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "panic") == NULL, "a panic: %s", kvo_last_error());
	FAILS(kvo_sim_write(e, k_addr[0], buf, (size_t)1 << 63), KVO_EINVAL);
	FAILS(kvo_sim_read(e, k_addr[0], (void*)(UINTPTR_MAX - 7), 16), KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "wraps") != NULL, "error: %s", kvo_last_error());
	FAILS(kvo_sim_read(e, k_addr[0], buf, (size_t)1 << 40), KVO_EINVAL); // beyond the simulated memory
	OK(kvo_sim_read(e, k_addr[0], buf, sizeof buf));
	void* p = NULL;
	FAILS(kvo_staging(e, "big", UINT64_MAX, &p, NULL), KVO_EINVAL);
	uint64_t freed = 0;
	FAILS(kvo_trim(e, UINT64_MAX, 0, &freed, NULL), KVO_EINVAL);

	uint8_t keys[2 * KVO_KEY_BYTES];
	make_key(keys, 1, 41);
	make_key(keys + KVO_KEY_BYTES, 2, 41);
	int64_t src[2] = {0, 1}, dst[2] = {2, 3};
	kvo_op_t st = 0, ld = 0, pl = 0;
	uintptr_t ev = 1;
	OK(kvo_store(e, keys, src, 2, NULL, NULL, 0, 0, &st));
	OK(kvo_op_wait(st, -1));
	FAILS(kvo_op_layer_event(st, 0, &ev), KVO_EINVAL);
	OK(kvo_load(e, keys, dst, 2, 0, 0, 0, 0, &ld));
	OK(kvo_op_wait(ld, -1));
	FAILS(kvo_op_layer_event(ld, 0, &ev), KVO_EINVAL);
	OK(kvo_load(e, keys, dst, 2, 0, 0, 1, 0, &pl));
	OK(kvo_op_wait(pl, -1));
	OK(kvo_op_layer_event(pl, LAYERS - 1, &ev));
	CHECK(ev == 0, "host backend layer event %" PRIuPTR, ev);
	FAILS(kvo_op_layer_event(pl, LAYERS, &ev), KVO_EINVAL);
	FAILS(kvo_op_layer_event(pl, -1, &ev), KVO_EINVAL);
	FAILS(kvo_op_layer_event(pl, 99, &ev), KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "99") != NULL, "error does not name the layer: %s", kvo_last_error());
	OK(kvo_op_release(st));
	OK(kvo_op_release(ld));
	OK(kvo_op_release(pl));
	size_t deleted = 0;
	OK(kvo_delete(e, keys, 2, &deleted));
}

static void test_stats_staging_trim(kvo_engine_t e) {
	char small[4];
	size_t need = 0;
	FAILS(kvo_stats_json(e, small, sizeof small, &need), KVO_EINVAL);
	CHECK(need > sizeof small, "needed %zu", need);
	char* buf = malloc(need);
	OK(kvo_stats_json(e, buf, need, &need));
	CHECK(strstr(buf, "\"backend\":\"host\"") != NULL, "stats: %s", buf);
	CHECK(strstr(buf, "\"backend_reason\":\"") != NULL, "stats: %s", buf);
	CHECK(strstr(buf, "\"go_maxprocs\":") != NULL, "stats: %s", buf);
	CHECK(strstr(buf, "\"outcomes\":[") != NULL, "stats: %s", buf);
	free(buf);

	void* p = NULL;
	uint64_t dev = 0;
	OK(kvo_staging(e, "tokens", 256, &p, &dev));
	CHECK(p != NULL, "staging pointer NULL");
	memset(p, 0x5a, 256);
	void* p2 = NULL;
	OK(kvo_staging(e, "tokens", 256, &p2, NULL));
	CHECK(p2 == p, "same name and size gave another buffer");
	FAILS(kvo_staging(e, "tokens", 512, &p2, NULL), KVO_EINVAL);
	FAILS(kvo_staging(e, "huge", 1 << 20, &p2, NULL), KVO_ENOMEM);

	uint64_t freed = 1, pending = 1;
	OK(kvo_trim(e, 0, -1, &freed, &pending));
	CHECK(freed == 0 && pending == 0, "trim 0 freed %" PRIu64 " pending %" PRIu64, freed, pending);
}

// stats_has reports whether the engine's stats JSON contains text.
static int stats_has(kvo_engine_t e, const char* text) {
	char buf[8192];
	size_t need = 0;
	OK(kvo_stats_json(e, buf, sizeof buf, &need));
	return strstr(buf, text) != NULL;
}

static int64_t stat_of(kvo_engine_t e, const char* name) {
	char buf[8192], pat[64];
	size_t need = 0;
	OK(kvo_stats_json(e, buf, sizeof buf, &need));
	snprintf(pat, sizeof pat, "\"%s\":", name);
	const char* p = strstr(buf, pat);
	CHECK(p != NULL, "no %s in %s", name, buf);
	return strtoll(p + strlen(pat), NULL, 10);
}

// small_engine is an engine whose pool holds blocks blocks of one page
// (4 KiB) each, in one region.
static kvo_engine_t small_engine(int blocks) {
	char cfg[1024];
	snprintf(cfg, sizeof cfg,
	         "{\"pool_bytes\": %d, \"first_region_bytes\": %d, \"backend\": \"host\", \"staging_bytes\": 4096,"
	         " \"skip_memory_check\": true, \"policy\": \"lru\","
	         " \"layout\": {\"kind\": \"layer-separate\", \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 64,"
	         " \"dtype_bytes\": 2, \"tokens_per_block\": 4, \"num_blocks\": 8}}",
	         blocks * 4096, blocks * 4096);
	kvo_engine_t e = 0;
	OK(kvo_engine_create(cfg, &e));
	CHECK(stat_of(e, "slots_total") == blocks, "%" PRId64 " slots, want %d", stat_of(e, "slots_total"), blocks);
	return e;
}

static void store_all(kvo_engine_t e, const uint8_t* keys, const int64_t* ids, size_t n, const uint8_t* parent,
                      const uint8_t* parents) {
	kvo_op_t op = 0;
	OK(kvo_store(e, keys, ids, n, parent, parents, 0, 0, &op));
	OK(kvo_op_wait(op, -1));
	check_outcomes(op, n, KVO_OUTCOME_STORED);
	OK(kvo_op_release(op));
}

// A sequence stored over several calls stays one chain when each call
// names the block before its first key (parent), or each key's parent
// (parents): eviction then takes the sequence's tail, not its middle.
static void test_store_parents(void) {
	uint8_t seq[3 * KVO_KEY_BYTES], other[2 * KVO_KEY_BYTES];
	for (int i = 0; i < 3; i++) make_key(seq + i * KVO_KEY_BYTES, 500 + i, 1);
	make_key(other, 600, 1);
	make_key(other + KVO_KEY_BYTES, 601, 1);
	int64_t ids[3] = {0, 1, 2}, id3 = 3, id4 = 4;
	size_t hits = 0;

	// parent: three slots; the fourth block evicts seq[2], the tail.
	kvo_engine_t e = small_engine(3);
	store_all(e, seq, ids, 2, NULL, NULL);
	store_all(e, seq + 2 * KVO_KEY_BYTES, ids + 2, 1, seq + KVO_KEY_BYTES, NULL);
	store_all(e, other, &id3, 1, NULL, NULL);
	OK(kvo_lookup(e, seq, 3, 0, &hits, NULL));
	CHECK(hits == 2, "hits %zu: the tail of the sequence was not the block evicted", hits);
	CHECK(stat_of(e, "orphans") == 0, "orphans %" PRId64, stat_of(e, "orphans"));
	OK(kvo_engine_destroy(e));

	// Without it seq[2] starts a chain of its own, and seq[1] (the oldest
	// chain's tail) is evicted: the middle of the sequence.
	e = small_engine(3);
	store_all(e, seq, ids, 2, NULL, NULL);
	store_all(e, seq + 2 * KVO_KEY_BYTES, ids + 2, 1, NULL, NULL);
	store_all(e, other, &id3, 1, NULL, NULL);
	OK(kvo_lookup(e, seq, 3, 0, &hits, NULL));
	CHECK(hits < 2, "hits %zu without parent: the control does not show what parent changes", hits);
	OK(kvo_engine_destroy(e));

	// parents: one call with a new sequence's first block and seq[2].
	e = small_engine(4);
	store_all(e, seq, ids, 2, NULL, NULL);
	uint8_t mixed[2 * KVO_KEY_BYTES], parents[2 * KVO_KEY_BYTES];
	memcpy(mixed, other, KVO_KEY_BYTES);
	memcpy(mixed + KVO_KEY_BYTES, seq + 2 * KVO_KEY_BYTES, KVO_KEY_BYTES);
	memset(parents, 0, KVO_KEY_BYTES);
	memcpy(parents + KVO_KEY_BYTES, seq + KVO_KEY_BYTES, KVO_KEY_BYTES);
	int64_t mixed_ids[2] = {3, 2};
	store_all(e, mixed, mixed_ids, 2, NULL, parents);
	store_all(e, other + KVO_KEY_BYTES, &id4, 1, NULL, NULL);
	OK(kvo_lookup(e, seq, 3, 0, &hits, NULL));
	CHECK(hits >= 2, "hits %zu: the middle of the sequence was evicted", hits);
	CHECK(stat_of(e, "orphans") == 0, "orphans %" PRId64, stat_of(e, "orphans"));

	// Refused: parent and parents both, a key its own parent, a key twice.
	kvo_op_t op = 0;
	uint8_t zero[KVO_KEY_BYTES] = {0};
	FAILS(kvo_store(e, mixed, mixed_ids, 2, zero, parents, 0, 0, &op), KVO_EINVAL);
	memcpy(parents, mixed, KVO_KEY_BYTES);
	FAILS(kvo_store(e, mixed, mixed_ids, 2, NULL, parents, 0, 0, &op), KVO_EINVAL);
	CHECK(strstr(kvo_last_error(), "its own parent") != NULL, "error: %s", kvo_last_error());
	uint8_t twice[2 * KVO_KEY_BYTES];
	memcpy(twice, other, KVO_KEY_BYTES);
	memcpy(twice + KVO_KEY_BYTES, other, KVO_KEY_BYTES);
	memset(parents, 0, sizeof parents);
	FAILS(kvo_store(e, twice, mixed_ids, 2, NULL, parents, 0, 0, &op), KVO_EINVAL);
	CHECK(op == 0, "op written on error");
	OK(kvo_engine_destroy(e));
}

// Background growth: paused, kvo_wait_grown times out; resumed, it
// returns KVO_OK with every region pinned.
static void test_growth(void) {
	kvo_engine_t e = 0;
	OK(kvo_engine_create("{\"pool_bytes\": 268435456, \"first_region_bytes\": 1048576, \"region_bytes\": 1048576,"
	                     " \"backend\": \"host\", \"staging_bytes\": 4096, \"skip_memory_check\": true,"
	                     " \"layout\": {\"kind\": \"layer-separate\", \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 64,"
	                     " \"dtype_bytes\": 2, \"tokens_per_block\": 4, \"num_blocks\": 8}}",
	                     &e));
	OK(kvo_pause_growth(e));
	OK(kvo_pause_growth(e)); // idempotent
	CHECK(stats_has(e, "\"growth_paused\":true"), "growth_paused not set");
	int64_t total = stat_of(e, "regions_total");
	CHECK(total == 256, "regions_total %" PRId64, total);
	FAILS(kvo_wait_grown(e, 0), KVO_ETIMEOUT);
	FAILS(kvo_wait_grown(e, 20 * 1000 * 1000), KVO_ETIMEOUT);
	int64_t paused_at = stat_of(e, "regions");
	CHECK(paused_at < total, "%" PRId64 " of %" PRId64 " regions pinned while paused", paused_at, total);
	usleep(20 * 1000);
	CHECK(stat_of(e, "regions") == paused_at, "regions %" PRId64 " grew from %" PRId64 " while paused",
	      stat_of(e, "regions"), paused_at);
	OK(kvo_resume_growth(e));
	OK(kvo_resume_growth(e));
	CHECK(stats_has(e, "\"growth_paused\":false"), "growth_paused still set");
	OK(kvo_wait_grown(e, -1));
	OK(kvo_wait_grown(e, 0));
	CHECK(stat_of(e, "regions") == total, "regions %" PRId64 " of %" PRId64 " after kvo_wait_grown",
	      stat_of(e, "regions"), total);
	OK(kvo_engine_destroy(e));
	FAILS(kvo_wait_grown(e, 0), KVO_ECLOSED);
	FAILS(kvo_pause_growth(e), KVO_ECLOSED);
	FAILS(kvo_resume_growth(e), KVO_ECLOSED);
	FAILS(kvo_wait_grown(0, 0), KVO_EINVAL);
}

// Stale handles: a released op or lease is KVO_ERELEASED in every call
// that takes it; a destroyed engine is KVO_ECLOSED in every call that takes
// it, while the ops and leases it handed out stay valid handles; a handle
// that never was one of its kind is KVO_EINVAL.
static void test_stale_handles(void) {
	kvo_engine_t e = 0;
	OK(kvo_engine_create(config, &e));
	uint8_t keys[2 * KVO_KEY_BYTES];
	make_key(keys, 1, 21);
	make_key(keys + KVO_KEY_BYTES, 2, 21);
	int64_t src[2] = {0, 1}, dst[2] = {2, 3};
	uint8_t out[2];
	uintptr_t ev = 0;
	int done = 0;
	size_t hits = 0, count = 0;

	// A released op.
	kvo_op_t op = 0;
	OK(kvo_store(e, keys, src, 2, NULL, NULL, 0, 0, &op));
	OK(kvo_op_wait(op, -1));
	OK(kvo_op_release(op));
	FAILS(kvo_op_wait(op, -1), KVO_ERELEASED);
	FAILS(kvo_op_wait(op, 0), KVO_ERELEASED);
	FAILS(kvo_op_query(op, &done), KVO_ERELEASED);
	FAILS(kvo_op_stream_wait(op, 0), KVO_ERELEASED);
	FAILS(kvo_op_event(op, &ev), KVO_ERELEASED);
	FAILS(kvo_op_layer_event(op, 0, &ev), KVO_ERELEASED);
	FAILS(kvo_op_outcomes(op, out, 2), KVO_ERELEASED);
	FAILS(kvo_op_release(op), KVO_ERELEASED);
	// Of the right kind but never issued: KVO_EINVAL, not KVO_ERELEASED.
	FAILS(kvo_op_wait(op + 1000000, 0), KVO_EINVAL);
	FAILS(kvo_op_release(op + 1000000), KVO_EINVAL);

	// A released lease, and one taken over by a load.
	kvo_lease_t lease = 0;
	OK(kvo_lookup(e, keys, 2, 1, &hits, &lease));
	CHECK(hits == 2 && lease != 0, "hits %zu lease %" PRIu64, hits, lease);
	OK(kvo_lease_release(lease));
	FAILS(kvo_lease_release(lease), KVO_ERELEASED);
	FAILS(kvo_load(e, keys, dst, 2, lease, 0, 0, 0, &op), KVO_ERELEASED);
	OK(kvo_lookup(e, keys, 2, 1, &hits, &lease));
	OK(kvo_load(e, keys, dst, 2, lease, 0, 0, 0, &op));
	FAILS(kvo_lease_release(lease), KVO_ERELEASED);
	kvo_op_t op2 = 0;
	FAILS(kvo_load(e, keys, dst, 2, lease, 0, 0, 0, &op2), KVO_ERELEASED);
	OK(kvo_op_wait(op, -1));
	OK(kvo_op_release(op));
	FAILS(kvo_lease_release(lease + 1000000), KVO_EINVAL);

	// A destroyed engine: every call taking it is KVO_ECLOSED; its op and
	// lease stay valid and must still be released.
	OK(kvo_store(e, keys, src, 2, NULL, NULL, 0, 0, &op));
	OK(kvo_lookup(e, keys, 2, 1, &hits, &lease));
	OK(kvo_engine_destroy(e));
	FAILS(kvo_engine_destroy(e), KVO_ECLOSED);
	char buf[64];
	size_t need = 0;
	FAILS(kvo_engine_config_json(e, buf, sizeof buf, &need), KVO_ECLOSED);
	FAILS(kvo_lookup(e, keys, 2, 0, &hits, NULL), KVO_ECLOSED);
	FAILS(kvo_store(e, keys, src, 2, NULL, NULL, 0, 0, &op2), KVO_ECLOSED);
	FAILS(kvo_load(e, keys, dst, 2, lease, 0, 0, 0, &op2), KVO_ECLOSED); // the lease stays the caller's
	void* p = NULL;
	FAILS(kvo_staging(e, "x", 64, &p, NULL), KVO_ECLOSED);
	FAILS(kvo_stats_json(e, buf, sizeof buf, &need), KVO_ECLOSED);
	FAILS(kvo_trim(e, 0, -1, NULL, NULL), KVO_ECLOSED);
	FAILS(kvo_delete(e, keys, 2, &count), KVO_ECLOSED);
	FAILS(kvo_clear(e, "", &count), KVO_ECLOSED);
	FAILS(kvo_sim_write(e, 0, buf, 1), KVO_ECLOSED);
	FAILS(kvo_sim_read(e, 0, buf, 1), KVO_ECLOSED);
	FAILS(kvo_wait_grown(e, 0), KVO_ECLOSED);
	FAILS(kvo_pause_growth(e), KVO_ECLOSED);
	FAILS(kvo_resume_growth(e), KVO_ECLOSED);
	FAILS(kvo_lookup(e + 1000000, keys, 2, 0, &hits, NULL), KVO_EINVAL);
	OK(kvo_op_wait(op, -1));
	OK(kvo_op_query(op, &done));
	CHECK(done == 1, "done = %d", done);
	OK(kvo_op_outcomes(op, out, 2));
	OK(kvo_op_release(op));
	OK(kvo_lease_release(lease));
	FAILS(kvo_lease_release(lease), KVO_ERELEASED);
}

// Several threads storing, looking up and loading disjoint blocks of one
// engine at once, each checking its own errors and data.
typedef struct {
	kvo_engine_t e;
	int id;
} worker_arg;

enum { THREADS = 4, PER_THREAD = 4, ROUNDS = 25 };

static void* worker(void* p) {
	worker_arg* a = p;
	uint8_t keys[PER_THREAD * KVO_KEY_BYTES];
	int64_t src[PER_THREAD], dst[PER_THREAD];
	for (int r = 0; r < ROUNDS; r++) {
		for (int i = 0; i < PER_THREAD; i++) {
			make_key(keys + i * KVO_KEY_BYTES, a->id * 1000 + r * PER_THREAD + i, 3);
			src[i] = a->id * 2 * PER_THREAD + i;
			dst[i] = src[i] + PER_THREAD;
			write_block(a->e, (int)src[i], r);
		}
		kvo_op_t op;
		OK(kvo_store(a->e, keys, src, PER_THREAD, NULL, NULL, 0, 0, &op));
		OK(kvo_op_wait(op, -1));
		check_outcomes(op, PER_THREAD, KVO_OUTCOME_STORED);
		OK(kvo_op_release(op));
		// An error on this thread leaves a message only here.
		int64_t bad = NUM_BLOCKS + a->id;
		FAILS(kvo_store(a->e, keys, &bad, 1, NULL, NULL, 0, 0, &op), KVO_EINVAL);
		char want[32];
		snprintf(want, sizeof want, "%d", NUM_BLOCKS + a->id);
		CHECK(strstr(kvo_last_error(), want) != NULL, "thread %d sees another thread's error: %s", a->id, kvo_last_error());
		size_t hits = 0;
		kvo_lease_t lease = 0;
		OK(kvo_lookup(a->e, keys, PER_THREAD, 1, &hits, &lease));
		CHECK(hits == PER_THREAD, "thread %d hits %zu", a->id, hits);
		OK(kvo_load(a->e, keys, dst, PER_THREAD, lease, 0, 0, 0, &op));
		while (kvo_op_wait(op, 1000) == KVO_ETIMEOUT) {
		}
		check_outcomes(op, PER_THREAD, KVO_OUTCOME_LOADED);
		OK(kvo_op_release(op));
		for (int i = 0; i < PER_THREAD; i++) {
			CHECK(block_matches(a->e, (int)dst[i], (int)src[i], r), "thread %d round %d block %d", a->id, r, i);
		}
		size_t deleted;
		OK(kvo_delete(a->e, keys, PER_THREAD, &deleted));
	}
	return NULL;
}

static void test_threads(kvo_engine_t e) {
	pthread_t th[THREADS];
	worker_arg args[THREADS];
	for (int i = 0; i < THREADS; i++) {
		args[i] = (worker_arg){e, i};
		CHECK(pthread_create(&th[i], NULL, worker, &args[i]) == 0, "pthread_create");
	}
	for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
}

static void test_fork(kvo_engine_t e) {
	pid_t pid = fork();
	CHECK(pid >= 0, "fork");
	if (pid == 0) {
		size_t hits;
		uint8_t key[KVO_KEY_BYTES] = {0};
		int rc = kvo_lookup(e, key, 1, 0, &hits, NULL);
		int ok = rc == KVO_EFORK && strstr(kvo_last_error(), "fork") != NULL;
		if (!ok) fprintf(stderr, "child: rc %d, error %s\n", rc, kvo_last_error());
		_exit(ok ? 0 : 1);
	}
	int status = 0;
	CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child was not refused with KVO_EFORK");
}

int main(void) {
	CHECK(kvo_abi_version() == KVO_ABI_VERSION, "ABI %d", kvo_abi_version());
	CHECK(kvo_last_error()[0] == '\0', "fresh thread has an error");
	test_chain_keys();

	kvo_engine_t e = 0;
	OK(kvo_engine_create(config, &e));
	CHECK(e != 0, "engine handle 0");
	parse_layout(e);
	test_round_trip(e);
	test_errors(e);
	test_bad_values(e);
	test_stats_staging_trim(e);
	test_stale_handles();
	test_store_parents();
	test_growth();
	test_threads(e);
	test_fork(e);

	OK(kvo_engine_destroy(e));
	FAILS(kvo_engine_destroy(e), KVO_ECLOSED);
	size_t hits;
	uint8_t key[KVO_KEY_BYTES] = {0};
	FAILS(kvo_lookup(e, key, 1, 0, &hits, NULL), KVO_ECLOSED);
	printf("abi_test: ok\n");
	return 0;
}
