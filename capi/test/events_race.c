// events_race drives kvo_events_open, kvo_events_poll, kvo_events_dropped
// and kvo_events_close on several pthreads while another thread closes the
// stream and the main thread destroys the engine, round after round. Every
// call must return KVO_OK or a documented code for the race (KVO_ECLOSED
// once the engine is destroyed; KVO_EINVAL for no stream open, or one
// already open), never KVO_EFAIL, and every kvo_engine_destroy KVO_OK.
// Built and run by capi's Go test (TestEventsRaceABI); it prints the
// failures and exits non-zero if there were any.

#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvoffload.h"

enum { ROUNDS = 300, THREADS = 3, BUF = 1 << 20 };

static const char* config =
    "{\"pool_bytes\": 1048576, \"backend\": \"host\", \"staging_bytes\": -1,"
    " \"skip_memory_check\": true, \"namespace\": \"events-race\","
    " \"layout\": {\"kind\": \"layer-separate\", \"layers\": 2, \"kv_heads\": 2, \"head_dim\": 8,"
    " \"dtype_bytes\": 2, \"tokens_per_block\": 4, \"num_blocks\": 16}}";

static atomic_int failures;
static atomic_int calls;

// check sorts one call's result; it returns 1 once the engine is destroyed.
static int check(const char* call, int rc, int round) {
	atomic_fetch_add(&calls, 1);
	if (rc == KVO_OK) return 0;
	if (rc == KVO_ECLOSED) return 1;
	const char* msg = kvo_last_error();
	if (rc == KVO_EINVAL && (strstr(msg, "no event stream") != NULL || strstr(msg, "already open") != NULL)) return 0;
	if (atomic_fetch_add(&failures, 1) < 20) {
		fprintf(stderr, "round %d: %s returned %d: %s\n", round, call, rc, msg);
	}
	return 1;
}

struct arg {
	kvo_engine_t e;
	int round;
	int kind; // 0: open, poll, dropped, close; 1: poll, dropped; 2: close
};

static void* worker(void* p) {
	struct arg* a = p;
	char* buf = malloc(BUF);
	for (int done = 0; !done;) {
		size_t need = 0;
		uint64_t dropped = 0;
		if (a->kind == 0) done |= check("kvo_events_open", kvo_events_open(a->e, 4), a->round);
		if (a->kind <= 1) {
			done |= check("kvo_events_poll", kvo_events_poll(a->e, buf, BUF, &need), a->round);
			done |= check("kvo_events_dropped", kvo_events_dropped(a->e, &dropped), a->round);
		}
		if (a->kind != 1) done |= check("kvo_events_close", kvo_events_close(a->e), a->round);
	}
	free(buf);
	return NULL;
}

int main(void) {
	srand(52);
	int destroys_failed = 0;
	for (int r = 0; r < ROUNDS; r++) {
		kvo_engine_t e = 0;
		if (kvo_engine_create(config, &e) != KVO_OK) {
			fprintf(stderr, "round %d: kvo_engine_create: %s\n", r, kvo_last_error());
			return 1;
		}
		pthread_t th[THREADS];
		struct arg args[THREADS];
		for (int i = 0; i < THREADS; i++) {
			args[i] = (struct arg){.e = e, .round = r, .kind = i};
			if (pthread_create(&th[i], NULL, worker, &args[i]) != 0) {
				fprintf(stderr, "pthread_create\n");
				return 1;
			}
		}
		usleep((useconds_t)(rand() % 300));
		int rc = kvo_engine_destroy(e);
		if (rc != KVO_OK) {
			destroys_failed++;
			if (destroys_failed <= 20) fprintf(stderr, "round %d: kvo_engine_destroy returned %d: %s\n", r, rc, kvo_last_error());
		}
		for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
		if (kvo_engine_destroy(e) != KVO_ECLOSED) {
			fprintf(stderr, "round %d: a second destroy is not KVO_ECLOSED\n", r);
			return 1;
		}
	}
	int f = atomic_load(&failures);
	printf("events_race: %d rounds, %d calls, %d failed calls, %d failed destroys\n", ROUNDS, atomic_load(&calls), f, destroys_failed);
	if (f > 0 || destroys_failed > 0) return 1;
	printf("events_race: ok\n");
	return 0;
}
