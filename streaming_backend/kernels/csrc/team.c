/* The kernels' thread team: see team.h for what it promises.
 *
 * One team per process, held by one kernel call at a time (a call on another thread meanwhile
 * runs alone). Its workers are threads of its own, started as calls ask for them; between jobs a
 * worker spins for SPIN_NS (a step's calls follow each other within microseconds), then sleeps on
 * a futex until the next job.
 *
 * A job is published by a sequence number `gen`: odd while the master writes the job, even once
 * it may be taken. Every chunk has a state word: its job's number times 4, plus 0 while open, 1
 * while a thread stores it, 2 once stored. Threads take chunks by a compare-and-swap on `claim`
 * (the job's number and the next chunk), compute one into their scratch, and commit it by a
 * compare-and-swap of its state from open to storing. A worker's copy of a finished job can take
 * nothing and commit nothing, since the words name another job by then. */
#define _GNU_SOURCE
#include "team.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define SPIN_NS 200000    /* a worker spins this long for the next job, then sleeps */
#define GRACE_NS 50000    /* the master's wait for a worker's chunk before it has timed one */
#define CLAIM_INDEX 24    /* claim: (job number << CLAIM_INDEX) | the next chunk */

typedef struct {
    void *memory;
    size_t bytes;
} Buffer;

struct TeamCall {
    int threads;  /* 1: alone */
    int solo;     /* not the team's: its buffers are its own */
    int depth;    /* nested enters on this thread */
    Buffer buffers[TEAM_BUFFERS];
};

typedef struct Retired {
    void *memory;
    struct Retired *next;
} Retired;

typedef struct {
    _Alignas(64) atomic_int busy;  /* between reading a job and finishing its chunks */
    int index;
    void *scratch;
    size_t scratch_bytes;
} Worker;

static struct {
    pthread_mutex_t lock;
    atomic_uintptr_t owner;  /* the holding thread's marker (below), 0 when free */
    TeamCall call;           /* the holder's: the team's buffers */
    _Alignas(64) atomic_uint_fast64_t gen;
    _Alignas(64) atomic_uint_fast64_t claim;
    _Alignas(64) atomic_uint wake;  /* the sleeping workers' futex word */
    atomic_int sleepers;
    TeamJob job;
    int job_workers;  /* the workers asked for the job (index below this) */
    _Atomic uint64_t state[TEAM_MOST_CHUNKS];
    _Atomic int64_t started[TEAM_MOST_CHUNKS];  /* when a chunk was taken (ns), 0 not yet */
    Worker workers[TEAM_MOST_THREADS];
    int worker_count;
    Retired *retired;  /* replaced buffers, freed once no worker is busy */
    void *scratch;     /* the master's */
    size_t scratch_bytes;
    atomic_llong jobs, worker_chunks, takeovers, contended;
    atomic_llong hold_ns;  /* tests: a worker's pause before it commits (a parked thread) */
} team = {.lock = PTHREAD_MUTEX_INITIALIZER};

static __thread char marker;    /* its address names the thread */
static __thread TeamCall solo;  /* a call that runs alone */

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A spinning thread's pause (x86's; elsewhere none). */
#if defined(__x86_64__) || defined(__i386__)
static inline void relax(void) { __builtin_ia32_pause(); }
#else
static inline void relax(void) {}
#endif

static void futex_wait(atomic_uint *word, unsigned value) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, value, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *word) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static uint64_t tag(uint64_t gen) { return (gen >> 1) << CLAIM_INDEX; }

static void *grow(void **memory, size_t *bytes, size_t want) {
    if (*bytes >= want) return *memory;
    free(*memory);
    const size_t size = (want + 63) / 64 * 64;
    *memory = aligned_alloc(64, size);
    *bytes = *memory ? size : 0;
    return *memory;
}

/* The chunks of job `gen` that this thread takes, each computed into scratch and stored if it
 * commits first; for the master, the time its own chunks took. */
static void take_chunks(const TeamJob *job, uint64_t gen, void *scratch, int worker, int64_t *spent, int64_t *count) {
    const uint64_t open = gen << 2;
    for (;;) {
        uint64_t word = atomic_load(&team.claim);
        if ((word >> CLAIM_INDEX) != (tag(gen) >> CLAIM_INDEX)) return;  /* another job's */
        const int64_t chunk = (int64_t)(word & ((1u << CLAIM_INDEX) - 1));
        if (chunk >= job->chunks) return;
        if (!atomic_compare_exchange_weak(&team.claim, &word, word + 1)) continue;
        const int64_t start = now_ns();
        atomic_store_explicit(&team.started[chunk], start, memory_order_relaxed);
        const TeamChunk taken = {&team.state[chunk], open};
        job->compute(job->args, chunk, scratch, &taken);
        if (worker) {
            const long long hold = atomic_load_explicit(&team.hold_ns, memory_order_relaxed);
            if (hold > 0) {
                const struct timespec pause = {hold / 1000000000, hold % 1000000000};
                nanosleep(&pause, NULL);
            }
        }
        uint64_t expected = open;
        if (atomic_compare_exchange_strong(&team.state[chunk], &expected, open | 1)) {
            job->store(job->args, chunk, scratch);
            atomic_store_explicit(&team.state[chunk], open | 2, memory_order_release);
            if (worker) atomic_fetch_add_explicit(&team.worker_chunks, 1, memory_order_relaxed);
        }
        if (spent) {
            *spent += now_ns() - start;
            *count += 1;
        }
    }
}

/* The next published job after `seen`: spin, then sleep. */
static uint64_t next_job(uint64_t seen) {
    int64_t until = now_ns() + SPIN_NS;
    for (unsigned i = 1;; i++) {
        uint64_t gen = atomic_load_explicit(&team.gen, memory_order_acquire);
        if (gen != seen && !(gen & 1)) return gen;
        if (i % 64 == 0 && now_ns() > until) {
            const unsigned word = atomic_load(&team.wake);
            atomic_fetch_add(&team.sleepers, 1);
            gen = atomic_load(&team.gen);
            if (gen == seen || (gen & 1)) futex_wait(&team.wake, word);
            atomic_fetch_sub(&team.sleepers, 1);
            until = now_ns() + SPIN_NS;
        }
        relax();
    }
}

static void *work(void *arg) {
    Worker *w = arg;
    TeamJob job;  /* this worker's copy */
    uint64_t seen = 0;
    for (;;) {
        const uint64_t gen = next_job(seen);
        seen = gen;
        atomic_store(&w->busy, 1);  /* before reading the job: the master frees nothing it names */
        if (atomic_load(&team.gen) != gen) {
            atomic_store(&w->busy, 0);
            continue;
        }
        memcpy(&job, &team.job, sizeof job);
        const int asked = team.job_workers;
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load(&team.gen) == gen && w->index < asked &&
            grow(&w->scratch, &w->scratch_bytes, job.scratch_bytes ? job.scratch_bytes : 64))
            take_chunks(&job, gen, w->scratch, 1, NULL, NULL);
        atomic_store(&w->busy, 0);
    }
    return NULL;
}

/* A child of fork has none of the workers (nor a holder of the team): it starts afresh. */
static void forked_child(void) {
    pthread_mutex_init(&team.lock, NULL);
    atomic_store(&team.owner, 0);
    atomic_store(&team.sleepers, 0);
    for (int i = 0; i < team.worker_count; i++) atomic_store(&team.workers[i].busy, 0);
    team.worker_count = 0;
    memset(&solo, 0, sizeof solo);
}

/* Workers up to `count` (fewer where a thread cannot be started). */
static void start_workers(int count) {
    static int registered;
    if (!registered) registered = pthread_atfork(NULL, NULL, forked_child) == 0;
    if (count > TEAM_MOST_THREADS) count = TEAM_MOST_THREADS;
    while (team.worker_count < count) {
        Worker *w = &team.workers[team.worker_count];
        w->index = team.worker_count;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t thread;
        const int failed = pthread_create(&thread, &attr, work, w);
        pthread_attr_destroy(&attr);
        if (failed) return;
        team.worker_count++;
    }
}

TeamCall *team_enter(int threads) {
    const uintptr_t me = (uintptr_t)&marker;
    if (atomic_load(&team.owner) == me) {
        team.call.depth++;
        return &team.call;
    }
    if (solo.depth > 0) {
        solo.depth++;
        return &solo;
    }
    if (threads > 1) {
        if (pthread_mutex_trylock(&team.lock) == 0) {
            atomic_store(&team.owner, me);
            start_workers(threads - 1);
            team.call.threads = team.worker_count + 1 < threads ? team.worker_count + 1 : threads;
            team.call.depth = 1;
            return &team.call;
        }
        atomic_fetch_add_explicit(&team.contended, 1, memory_order_relaxed);
    }
    memset(&solo, 0, sizeof solo);
    solo.threads = 1;
    solo.solo = 1;
    solo.depth = 1;
    return &solo;
}

void team_leave(TeamCall *call) {
    if (--call->depth > 0) return;
    if (call->solo) {
        for (int i = 0; i < TEAM_BUFFERS; i++) free(call->buffers[i].memory);
        memset(call, 0, sizeof *call);
        return;
    }
    /* No worker outlives the call: a parked one may still be inside a chunk, reading the weights
     * or the cache, which the caller may free once the call returns. It stops at its next tile
     * (its chunk is taken), so this waits only while the scheduler keeps it off a core: once a
     * call, not once a job as a barrier would. */
    for (int i = 0; i < team.worker_count; i++)
        for (unsigned spins = 1; atomic_load(&team.workers[i].busy); spins++) {
            relax();
            if (spins % 1024 == 0) sched_yield();
        }
    atomic_store(&team.owner, 0);
    pthread_mutex_unlock(&team.lock);
}

int team_threads(const TeamCall *call) { return call->threads; }

void *team_buffer(TeamCall *call, int which, size_t bytes) {
    Buffer *b = &call->buffers[which];
    if (b->bytes >= bytes && b->memory) return b->memory;
    if (call->solo) return grow(&b->memory, &b->bytes, bytes);
    /* a parked worker may still read the old one: retire it */
    if (b->memory) {
        Retired *r = malloc(sizeof *r);
        if (r == NULL) return NULL;
        r->memory = b->memory;
        r->next = team.retired;
        team.retired = r;
    }
    const size_t size = ((bytes > b->bytes + b->bytes / 2 ? bytes : b->bytes + b->bytes / 2) + 63) / 64 * 64;
    b->memory = aligned_alloc(64, size);
    b->bytes = b->memory ? size : 0;
    return b->memory;
}

int team_taken(const TeamChunk *taken) {
    return atomic_load_explicit((_Atomic uint64_t *)taken->state, memory_order_relaxed) != taken->open;
}

/* Free the retired buffers if no worker is busy (gen is odd: none starts reading a job now). */
static void free_retired(void) {
    for (int i = 0; i < team.worker_count; i++)
        if (atomic_load(&team.workers[i].busy)) return;
    while (team.retired) {
        Retired *r = team.retired;
        team.retired = r->next;
        free(r->memory);
        free(r);
    }
}

static int run_alone(const TeamJob *job, TeamCall *call) {
    void *scratch = call->solo ? NULL : grow(&team.scratch, &team.scratch_bytes, job->scratch_bytes);
    if (call->solo) scratch = malloc(job->scratch_bytes ? job->scratch_bytes : 64);
    if (scratch == NULL) return TS_NO_MEMORY;
    const uint64_t unused = 0;
    const TeamChunk nobody = {&unused, 0};
    for (int64_t chunk = 0; chunk < job->chunks; chunk++) {
        job->compute(job->args, chunk, scratch, &nobody);
        job->store(job->args, chunk, scratch);
    }
    if (call->solo) free(scratch);
    return TS_OK;
}

int team_run(TeamCall *call, const TeamJob *job) {
    if (job->chunks <= 0) return TS_OK;
    if (job->chunks > TEAM_MOST_CHUNKS) return TS_BAD_ARGS;
    int workers = call->threads - 1;
    if (workers > job->chunks - 1) workers = (int)job->chunks - 1;
    if (call->solo || job->alone || workers < 1) return run_alone(job, call);
    if (grow(&team.scratch, &team.scratch_bytes, job->scratch_bytes ? job->scratch_bytes : 64) == NULL)
        return TS_NO_MEMORY;
    /* publish: odd while written */
    const uint64_t gen = atomic_load(&team.gen) + 2;
    atomic_store(&team.gen, gen - 1);
    free_retired();
    memcpy(&team.job, job, sizeof *job);
    team.job_workers = workers;
    const uint64_t open = gen << 2;
    for (int64_t c = 0; c < job->chunks; c++) {
        atomic_store_explicit(&team.state[c], open, memory_order_relaxed);
        atomic_store_explicit(&team.started[c], 0, memory_order_relaxed);
    }
    atomic_store(&team.claim, tag(gen));
    atomic_store(&team.gen, gen);
    if (atomic_load(&team.sleepers) > 0) {
        atomic_fetch_add(&team.wake, 1);
        futex_wake_all(&team.wake);
    }
    atomic_fetch_add_explicit(&team.jobs, 1, memory_order_relaxed);
    int64_t spent = 0, count = 0;
    take_chunks(job, gen, team.scratch, 0, &spent, &count);
    /* every chunk stored: wait for a worker's chunk about as long as one takes, then take it over */
    const int64_t grace = count ? 2 * spent / count : GRACE_NS;
    for (int64_t c = 0; c < job->chunks; c++) {
        int64_t waiting = 0;
        for (;;) {
            const uint64_t state = atomic_load_explicit(&team.state[c], memory_order_acquire);
            if (state == (open | 2)) break;
            if (state == open) {
                const int64_t now = now_ns();
                if (!waiting) waiting = now;
                const int64_t started = atomic_load_explicit(&team.started[c], memory_order_relaxed);
                if (now - (started > 0 && started < waiting ? started : waiting) > grace) {
                    const TeamChunk taken = {&team.state[c], open};
                    job->compute(job->args, c, team.scratch, &taken);
                    uint64_t expected = open;
                    if (atomic_compare_exchange_strong(&team.state[c], &expected, open | 1)) {
                        job->store(job->args, c, team.scratch);
                        atomic_store_explicit(&team.state[c], open | 2, memory_order_release);
                        atomic_fetch_add_explicit(&team.takeovers, 1, memory_order_relaxed);
                    }
                    continue;
                }
            }
            relax();
        }
    }
    return TS_OK;
}

/* What the team did since load: out[0] jobs run with workers, [1] chunks workers stored, [2]
 * chunks the master took over, [3] calls run alone because another thread held the team, [4]
 * workers started, [5] workers inside a job now. */
int ts_team_stats(int64_t *out) {
    out[0] = atomic_load(&team.jobs);
    out[1] = atomic_load(&team.worker_chunks);
    out[2] = atomic_load(&team.takeovers);
    out[3] = atomic_load(&team.contended);
    pthread_mutex_lock(&team.lock);
    out[4] = team.worker_count;
    out[5] = 0;
    for (int i = 0; i < team.worker_count; i++) out[5] += atomic_load(&team.workers[i].busy);
    pthread_mutex_unlock(&team.lock);
    return TS_OK;
}

/* Tests: every worker pauses `ns` after computing a chunk, before it commits (as if parked). */
int ts_team_test_hold(int64_t ns) {
    atomic_store(&team.hold_ns, ns > 0 ? ns : 0);
    return TS_OK;
}
