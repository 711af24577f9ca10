/* The kernels' thread team (team.c): a call's work in chunks, taken by whichever thread runs.
 *
 * A job is `chunks` pieces of work, each computed into the computing thread's own scratch and
 * then stored into the job's output by the one thread that commits it first. The calling thread
 * (the master) takes chunks like the workers; once none is left untaken it does not wait for a
 * worker that the scheduler has parked in the middle of one: after a grace of about one chunk's
 * time it computes that chunk itself, and whichever thread commits first stores it. So a call
 * takes at most about the time the master would take alone, however the other threads are
 * scheduled (a busy machine parks a thread for milliseconds, and when every call of a step waited
 * for it, two threads ran slower than one), and every chunk is stored exactly once.
 *
 * A worker parked in a chunk the master took over may run on after that job, while the master
 * runs the call's next ones. It then touches only what stays valid: its own scratch, its copy of
 * the job, the team's buffers (team_buffer; a replaced one is freed only once no worker is
 * inside a job) and the model's memory (weights, caches, tables). It never stores: its commit
 * fails, since every chunk's state names its job. A job's compute must therefore read only
 * those; what the caller owns (the output, a residual, a bias) is for store, which runs while the
 * master waits for it. The call itself (team_leave) ends only once no worker is inside a job, so
 * the model's memory may be freed after it: the one wait for a parked thread is at the end of a
 * call (a whole decoder stack), not at every job's end.
 *
 * Bits: a chunk's result does not depend on which thread computes it (the kernels' rule), so
 * neither does the output. */
#ifndef TS_TEAM_H
#define TS_TEAM_H

#include <stddef.h>
#include <stdint.h>

#define TEAM_PAYLOAD 512  /* bytes of a job's arguments, copied by every thread that takes it */
#define TEAM_MOST_CHUNKS 4096
#define TEAM_MOST_THREADS 64

/* The team's buffers for what a job reads of the caller's (copied in by the master). */
enum { BUF_X, BUF_Q, BUF_PLACES, BUF_HIDDEN, BUF_WORK, TEAM_BUFFERS };

/* What a compute sees of its chunk: whether another thread has committed it meanwhile (the
 * compute may then stop early: its scratch will not be stored). */
typedef struct {
    const void *state;  /* the chunk's state word */
    uint64_t open;      /* its value while nobody has committed the chunk */
} TeamChunk;

typedef struct {
    int64_t chunks;        /* at most TEAM_MOST_CHUNKS */
    int alone;             /* run by the calling thread alone (its compute reads what the caller owns) */
    size_t scratch_bytes;  /* a thread's scratch for one chunk */
    /* the chunk's result into scratch; reads only what stays valid (see above) */
    void (*compute)(const void *args, int64_t chunk, void *scratch, const TeamChunk *taken);
    /* the chunk's result from scratch into the output */
    void (*store)(const void *args, int64_t chunk, const void *scratch);
    _Alignas(64) unsigned char args[TEAM_PAYLOAD];  /* the arguments, copied */
} TeamJob;

/* One kernel call's hold on the team: team_enter(threads) on the calling thread, then its jobs
 * and buffers, then team_leave. Where another thread holds the team, or threads is 1, the call
 * runs alone: its buffers are its own and freed at team_leave. Nested enters on one thread share
 * the outer call's hold. NULL: out of memory. */
typedef struct TeamCall TeamCall;
TeamCall *team_enter(int threads);
void team_leave(TeamCall *call);

/* The threads the call may run a job on (1: alone). */
int team_threads(const TeamCall *call);

/* One of the call's buffers (which: BUF_...), at least `bytes`, 64-byte aligned, valid until the
 * call asks that buffer for more; NULL when out of memory. */
void *team_buffer(TeamCall *call, int which, size_t bytes);

/* Every chunk of job on up to the call's threads, the caller among them; 0 (TS_OK), or
 * TS_NO_MEMORY with the output undefined. */
int team_run(TeamCall *call, const TeamJob *job);

/* Whether another thread has committed `taken`'s chunk (its compute may stop). */
int team_taken(const TeamChunk *taken);

/* What the team did since load (ts_team_stats): jobs run with workers, chunks computed by
 * workers and stored, chunks the master took over from a parked worker, solo calls because
 * another thread held the team. */
typedef struct {
    int64_t jobs, worker_chunks, takeovers, contended, workers;
} TeamStats;

#endif
