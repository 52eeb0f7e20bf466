// A stub libcuda.so.1: the CUDA driver API deviceop's cuda backend uses, emulated on the host,
// so that CI runs that backend's code (launch plans and parameter packing, the ledger's cuda
// path, events and cross-stream waits, host functions, graphs, the await wake-ups) without a GPU.
//
// Device memory is host memory. Each stream is a worker thread executing its queue in order;
// events complete when their stream reaches them and cuStreamWaitEvent makes a stream wait, so
// work on several streams runs concurrently and a missing dependency shows as a wrong result.
// Kernel launches go to a hook the test harness registers (stub_set_hooks): it gets the
// function's name, the grid and the parameter block, and computes the kernel's result on the
// host. Parameters are copied when the launch is enqueued (8 bytes each, as many as the harness
// says the function takes), as the driver copies them. During stream capture, work is recorded
// and cuGraphLaunch enqueues it again. A failed launch makes the context's error sticky: every
// later call returns it, as after a kernel fault.
//
// DEVICEOP_STUB_DEVICES=N (1 to 8, default 1) emulates N devices, each with its primary context.
// Streams, events and modules belong to the context current when they are made; recording an
// event on another context's stream, or launching a function on one, fails as on the driver
// (CUDA_ERROR_INVALID_HANDLE), and a call that makes one with no context current, or launches
// on a stream of a context that is not current, fails (CUDA_ERROR_INVALID_CONTEXT): work for two
// devices from one thread must switch contexts.
//
// DEVICEOP_STUB_INLINE=1 runs each item when it is enqueued, on the calling thread, instead of on
// the stream's worker: every stream then completes in issue order and a synchronize returns at
// once, so the host cost of deviceop's own paths can be timed and profiled without the workers'
// wake-ups (tests/stub_driver/queue_host_cost.py). Tests never set it: it hides missing dependencies.
//
// Build:  cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 stub_cuda.c -ldl -lpthread
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum {
    OK = 0, E_INVALID_VALUE = 1, E_OUT_OF_MEMORY = 2, E_INVALID_CONTEXT = 201, E_INVALID_HANDLE = 400,
    E_NOT_FOUND = 500, E_CAPTURE_INVALIDATED = 901
};
enum { MAX_DEVICES = 8 };
static int n_devices = 1;
static int contexts[MAX_DEVICES];  // the primary contexts: a context is the address of its slot
static __thread void *current;

typedef int (*launch_hook_t)(const char *name, const unsigned *grid, const unsigned *block, void **params);
typedef int (*nparams_hook_t)(const char *name);
static launch_hook_t launch_hook;
static nparams_hook_t nparams_hook;
static long launches, live_allocs;
static volatile int sticky;  // the context's error once a launch failed (0: healthy)

// The harness's hooks: launch(name, grid[3], block[3], params) -> CUresult; nparams(name) -> count.
void stub_set_hooks(launch_hook_t launch, nparams_hook_t nparams) {
    launch_hook = launch;
    nparams_hook = nparams;
}
long stub_launches(void) { return launches; }
long stub_live_allocs(void) { return live_allocs; }
// bytes freed in stream order whose free has not run yet: the pool serves them to a later
// allocation already, as the driver's does to one ordered after the free
static long long freeing;
// The harness widens race windows: cuMemcpyDtoHAsync's call itself takes this long (µs)
// (stub_dtoh_calls_waiting: how many such calls are waiting out the delay now)
static volatile unsigned dtoh_call_us;
static volatile long dtoh_waiting;
void stub_set_dtoh_call_delay(unsigned us) { dtoh_call_us = us; }
// The harness injects an error of one call (a fault switch): the next cuStreamWriteValue32, the
// arming of a completion flag, returns `code` once and enqueues nothing (0: no error)
static volatile int fail_write;
void stub_fail_next_write(int code) { __atomic_store_n(&fail_write, code, __ATOMIC_SEQ_CST); }
long stub_dtoh_calls_waiting(void) { return __atomic_load_n(&dtoh_waiting, __ATOMIC_SEQ_CST); }

typedef struct func {
    char name[128];
    int nparams;
    void *ctx;  // its module's context
} func_t;

typedef struct module {
    void *ctx;  // the context it was loaded into
} module_t;

// One cuEventRecord: done once its stream reaches it. A wait holds the record it saw when it was
// enqueued, so a later record of the same event (a reused handle) never releases it early.
typedef struct record {
    int done;
    long refs;  // the event's latest pointer, the queued record, queued waits
} record_t;

typedef struct event {
    record_t *latest;  // NULL: never recorded (complete)
    void *ctx;         // the context current when it was made
} event_t;

static pthread_mutex_t ev_mu = PTHREAD_MUTEX_INITIALIZER;  // every event and record
static pthread_cond_t ev_cv = PTHREAD_COND_INITIALIZER;

static void unref_record(record_t *r) {  // with ev_mu held
    if (r && --r->refs == 0) free(r);
}

enum { W_KERNEL, W_MEMSET, W_COPY, W_FREE, W_RECORD, W_WAIT, W_HOSTFN, W_WRITE32 };
typedef struct work {
    int kind;
    func_t *fn;
    unsigned grid[3], block[3];
    int nparams;
    uint64_t values[32];
    size_t block_bytes;  // a kernel launched with one argument buffer (extra): its size, in values
    size_t idx;          // its position in the graph it was captured into
    CUdeviceptr dst, src;
    size_t n;
    unsigned value;
    int width;
    record_t *rec;
    void (*hostfn)(void *);
    void *data;
    struct work *next;
} work_t;

typedef struct graph {
    work_t *items;
    size_t n, cap;
    // an executable: the captured graph it was made from, whose nodes name its items (that graph
    // must outlive the executable's node updates, as the driver's node handles must)
    const struct graph *from;
} graph_t;

typedef struct stream {
    pthread_mutex_t mu;
    pthread_cond_t cv;       // work queued / all done
    work_t *head, *tail;
    long pending;            // queued or running
    int capturing;
    graph_t *capture;
    pthread_t thread;
    void *ctx;               // the context current when it was made
} stream_t;

static CUresult push_work(graph_t *g, const work_t *w) {
    if (g->n == g->cap) {
        size_t cap = g->cap ? 2 * g->cap : 16;
        work_t *items = realloc(g->items, cap * sizeof(work_t));
        if (!items) return E_OUT_OF_MEMORY;
        g->items = items;
        g->cap = cap;
    }
    g->items[g->n] = *w;
    g->items[g->n].idx = g->n;
    g->n++;
    return OK;
}

// The GEMM stand-in's launches as they ran (cuBLAS's A, B, C and D, read from its argument
// block): tests/stub_driver's harness reads them to check that a replay used the call's pointers
enum { GEMM_LOG = 4096 };
static uint64_t gemm_log[GEMM_LOG][4];
static long gemm_logged, gemm_log_dropped;
static pthread_mutex_t gemm_log_mu = PTHREAD_MUTEX_INITIALIZER;
static const uint64_t GEMM_MAGIC = 0x4d4d454742555453ull;  // "STUBGEMM" in memory (the block's first word)
// Copy up to max logged launches (4 words each) to out and clear the log; the number copied.
// *dropped (if not NULL): launches not logged since the last call (the log was full).
long stub_gemm_log(uint64_t *out, long max, long *dropped) {
    pthread_mutex_lock(&gemm_log_mu);
    long n = gemm_logged < max ? gemm_logged : max;
    if (out) memcpy(out, gemm_log, (size_t)n * sizeof gemm_log[0]);
    if (dropped) *dropped = gemm_log_dropped;
    gemm_logged = gemm_log_dropped = 0;
    pthread_mutex_unlock(&gemm_log_mu);
    return n;
}
static void log_gemm(const work_t *w) {
    if ((w->block_bytes < 64 && w->nparams < 8) || w->values[0] != GEMM_MAGIC) return;
    pthread_mutex_lock(&gemm_log_mu);
    if (gemm_logged < GEMM_LOG) {
        gemm_log[gemm_logged][0] = w->values[1];
        gemm_log[gemm_logged][1] = w->values[2];
        gemm_log[gemm_logged][2] = w->values[3];
        gemm_log[gemm_logged][3] = w->values[4] - 128;  // (D is held plus 128: a word a pointer plus a constant)
        gemm_logged++;
    } else {
        gemm_log_dropped++;
    }
    pthread_mutex_unlock(&gemm_log_mu);
}

static CUresult release(CUdeviceptr p);

static void run_work(const work_t *w) {
    switch (w->kind) {
    case W_KERNEL: {
        if (sticky) return;  // no work runs once the context failed
        void *params[32];
        for (int i = 0; i < w->nparams; i++) params[i] = (void *)&w->values[i];
        __sync_fetch_and_add(&launches, 1);
        log_gemm(w);
        int r = launch_hook ? launch_hook(w->fn->name, w->grid, w->block, params) : OK;
        if (r && !sticky) sticky = r;
        return;
    }
    case W_COPY:
        if (!sticky) memmove((void *)w->dst, (const void *)w->src, w->n);
        return;
    case W_MEMSET:
        if (sticky) return;
        for (size_t i = 0; i < w->n; i++) {
            char *p = (char *)w->dst + i * w->width;
            if (w->width == 1) *(uint8_t *)p = (uint8_t)w->value;
            else if (w->width == 2) *(uint16_t *)p = (uint16_t)w->value;
            else *(uint32_t *)p = w->value;
        }
        return;
    case W_FREE:
        __sync_fetch_and_sub(&freeing, (long long)*(size_t *)((char *)w->dst - 256));
        release(w->dst);
        return;
    case W_RECORD:
        pthread_mutex_lock(&ev_mu);
        w->rec->done = 1;
        pthread_cond_broadcast(&ev_cv);
        unref_record(w->rec);
        pthread_mutex_unlock(&ev_mu);
        return;
    case W_WAIT:
        pthread_mutex_lock(&ev_mu);
        while (!w->rec->done) pthread_cond_wait(&ev_cv, &ev_mu);
        unref_record(w->rec);
        pthread_mutex_unlock(&ev_mu);
        return;
    case W_HOSTFN:
        if (!sticky) w->hostfn(w->data);  // as on CUDA: none after a context error
        return;
    case W_WRITE32:  // a stream memory operation: the device writes, nobody is woken
        if (!sticky) __atomic_store_n((uint32_t *)w->dst, w->value, __ATOMIC_RELEASE);
        return;
    }
}

// DEVICEOP_STUB_CHAOS_US=N: each stream waits a random 0..N microseconds before each item, so a
// missing cross-stream dependency shows up as a wrong result
static unsigned chaos_us;
static int inline_mode;  // DEVICEOP_STUB_INLINE=1
static int no_memops;    // DEVICEOP_STUB_NO_MEMOPS=1: stream memory operations are unsupported

static void *worker(void *arg) {
    stream_t *s = arg;
    unsigned seed = (unsigned)(uintptr_t)s;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->head) pthread_cond_wait(&s->cv, &s->mu);
        work_t *w = s->head;
        s->head = w->next;
        if (!s->head) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        if (chaos_us) {
            struct timespec ts = {0, (long)(rand_r(&seed) % (chaos_us + 1)) * 1000L};
            nanosleep(&ts, NULL);
        }
        run_work(w);
        free(w);
        pthread_mutex_lock(&s->mu);
        if (--s->pending == 0) pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

// work on a stream: recorded while it captures, else queued for its worker
static CUresult submit(void *hstream, const work_t *w) {
    stream_t *s = hstream;
    if (!s) return E_INVALID_VALUE;  // deviceop never uses the legacy stream
    if (s->capturing) {
        if (w->kind == W_RECORD || w->kind == W_WAIT || w->kind == W_HOSTFN || w->kind == W_FREE || w->kind == W_WRITE32)
            return E_CAPTURE_INVALIDATED;  // not recorded by deviceop's graphs
        return push_work(s->capture, w);
    }
    if (inline_mode) {
        run_work(w);
        return OK;
    }
    work_t *c = malloc(sizeof(work_t));
    if (!c) return E_OUT_OF_MEMORY;
    *c = *w;
    c->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = c;
    else s->head = c;
    s->tail = c;
    s->pending++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return OK;
}

// ---- init, devices, contexts -------------------------------------------------------------
CUresult cuInit(unsigned flags) {
    const char *c = getenv("DEVICEOP_STUB_CHAOS_US");
    chaos_us = c ? (unsigned)strtoul(c, NULL, 10) : 0;
    const char *i = getenv("DEVICEOP_STUB_INLINE");
    inline_mode = i && strcmp(i, "1") == 0;
    const char *m = getenv("DEVICEOP_STUB_NO_MEMOPS");
    no_memops = m && strcmp(m, "1") == 0;
    const char *d = getenv("DEVICEOP_STUB_DEVICES");
    n_devices = d ? (int)strtol(d, NULL, 10) : 1;
    if (n_devices < 1 || n_devices > MAX_DEVICES) n_devices = 1;
    return OK;
}
CUresult cuDriverGetVersion(int *v) { *v = 13000; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = n_devices; return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= n_devices) return E_INVALID_VALUE;
    *dev = ordinal;
    return OK;
}
CUresult cuDeviceGetName(char *name, int len, int dev) { snprintf(name, len, "deviceop stub device"); return OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    switch (attr) {
    case 75: *v = 9; break;    // compute capability major
    case 76: *v = 0; break;    // minor
    case 16: *v = 132; break;  // multiprocessors
    default: *v = 1;
    }
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    if (dev < 0 || dev >= n_devices) return E_INVALID_VALUE;
    *ctx = &contexts[dev];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease(int dev) { return OK; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }
CUresult cuCtxGetDevice(int *dev) {
    if (!current) return E_INVALID_CONTEXT;
    *dev = (int)((int *)current - contexts);
    return OK;
}
// the context a stream handle belongs to (NULL: a special handle, such as the legacy stream)
static void *ctx_of_stream(void *hs) { return (uintptr_t)hs > 2 ? ((stream_t *)hs)->ctx : NULL; }
CUresult cuCtxSynchronize(void) { return OK; }

// ---- memory --------------------------------------------------------------------------------
static int the_pool;
static long long used;
// The harness caps the pool (a fault switch): an allocation that would take the bytes in use
// past the cap fails with CUDA_ERROR_OUT_OF_MEMORY (0: no cap)
static volatile long long pool_cap;
void stub_set_pool_cap(long long bytes) { __atomic_store_n(&pool_cap, bytes, __ATOMIC_SEQ_CST); }
// the bytes of the pool in use, less those whose stream-ordered free is under way
long long stub_pool_used(void) { return __atomic_load_n(&used, __ATOMIC_SEQ_CST) - __atomic_load_n(&freeing, __ATOMIC_SEQ_CST); }
CUresult cuDeviceGetDefaultMemPool(void **pool, int dev) { *pool = &the_pool; return OK; }
CUresult cuMemPoolSetAttribute(void *pool, int attr, void *value) { return OK; }
CUresult cuMemPoolGetAttribute(void *pool, int attr, void *value) {
    *(unsigned long long *)value = attr == 7 /* CU_MEMPOOL_ATTR_USED_MEM_CURRENT */ ? (unsigned long long)used : 0;
    return OK;
}

// live allocations (start, size), for cuMemGetAddressRange: a small open list under a mutex
typedef struct range { CUdeviceptr start; size_t size; } range_t;
static range_t *ranges;
static size_t n_ranges, cap_ranges;
static pthread_mutex_t ranges_mu = PTHREAD_MUTEX_INITIALIZER;

static CUresult alloc(CUdeviceptr *p, size_t n) {
    // a size header keeps the pool's "used" figure honest; 256-byte aligned like the driver's
    void *raw = NULL;
    long long cap = __atomic_load_n(&pool_cap, __ATOMIC_SEQ_CST);
    if (cap && __atomic_load_n(&used, __ATOMIC_SEQ_CST) - __atomic_load_n(&freeing, __ATOMIC_SEQ_CST) + (long long)n > cap)
        return E_OUT_OF_MEMORY;
    if (posix_memalign(&raw, 256, n + 256) != 0) return E_OUT_OF_MEMORY;
    *(size_t *)raw = n;
    *p = (CUdeviceptr)((char *)raw + 256);
    __sync_fetch_and_add(&used, (long long)n);
    __sync_fetch_and_add(&live_allocs, 1);
    pthread_mutex_lock(&ranges_mu);
    if (n_ranges == cap_ranges) {
        size_t cap = cap_ranges ? cap_ranges * 2 : 256;
        range_t *r = realloc(ranges, cap * sizeof(range_t));
        if (r) { ranges = r; cap_ranges = cap; }
    }
    if (n_ranges < cap_ranges) ranges[n_ranges++] = (range_t){*p, n};
    pthread_mutex_unlock(&ranges_mu);
    return OK;
}
static CUresult release(CUdeviceptr p) {
    if (!p) return OK;
    pthread_mutex_lock(&ranges_mu);
    for (size_t i = 0; i < n_ranges; i++)
        if (ranges[i].start == p) { ranges[i] = ranges[--n_ranges]; break; }
    pthread_mutex_unlock(&ranges_mu);
    char *raw = (char *)p - 256;
    __sync_fetch_and_sub(&used, (long long)*(size_t *)raw);
    __sync_fetch_and_sub(&live_allocs, 1);
    free(raw);
    return OK;
}
// the stream of the last stream-ordered allocation (the harness checks which stream allocates)
static void *volatile last_async_alloc_stream;
void *stub_last_async_alloc_stream(void) { return last_async_alloc_stream; }
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *s) {
    last_async_alloc_stream = s;
    return alloc(p, n);
}
CUresult cuMemFreeAsync(CUdeviceptr p, void *s) {
    work_t w = {.kind = W_FREE, .dst = p};
    if (!s || !p) return release(p);
    long long n = (long long)*(size_t *)((char *)p - 256);
    __sync_fetch_and_add(&freeing, n);
    CUresult err = submit(s, &w);
    if (err) __sync_fetch_and_sub(&freeing, n);
    return err;
}
CUresult cuMemAlloc(CUdeviceptr *p, size_t n) { return alloc(p, n); }
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) { return alloc(p, n); }
CUresult cuMemFree_v2(CUdeviceptr p) { return release(p); }
CUresult cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    CUresult r = E_NOT_FOUND;
    pthread_mutex_lock(&ranges_mu);
    for (size_t i = 0; i < n_ranges; i++)
        if (ranges[i].start <= p && p < ranges[i].start + (ranges[i].size ? ranges[i].size : 1)) {
            if (base) *base = ranges[i].start;
            if (size) *size = ranges[i].size;
            r = OK;
            break;
        }
    pthread_mutex_unlock(&ranges_mu);
    return r;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) { return cuMemGetAddressRange(base, size, p); }
CUresult cuMemFree(CUdeviceptr p) { return release(p); }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) { *p = malloc(n); return *p ? OK : E_OUT_OF_MEMORY; }
CUresult cuMemFreeHost(void *p) { free(p); return OK; }

static CUresult copy(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) {
    work_t w = {.kind = W_COPY, .dst = dst, .src = src, .n = n};
    return submit(s, &w);
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, void *s) { return copy(dst, (CUdeviceptr)src, n, s); }
CUresult cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, void *s) {
    if (dtoh_call_us) {
        __atomic_add_fetch(&dtoh_waiting, 1, __ATOMIC_SEQ_CST);
        usleep(dtoh_call_us);
        __atomic_sub_fetch(&dtoh_waiting, 1, __ATOMIC_SEQ_CST);
    }
    return copy((CUdeviceptr)dst, src, n, s);
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, void *s) { return copy(dst, src, n, s); }
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, void *dctx, CUdeviceptr src, void *sctx, size_t n, void *s) {
    if (!dctx || !sctx) return E_INVALID_CONTEXT;
    return copy(dst, src, n, s);
}
static CUresult memset_n(CUdeviceptr dst, unsigned v, size_t n, int width, void *s) {
    work_t w = {.kind = W_MEMSET, .dst = dst, .n = n, .value = v, .width = width};
    return submit(s, &w);
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void *s) { return memset_n(d, v, n, 1, s); }
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, void *s) { return memset_n(d, v, n, 2, s); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, void *s) { return memset_n(d, v, n, 4, s); }

// ---- streams, events, host functions -------------------------------------------------------
CUresult cuStreamCreate(void **hs, unsigned flags) {
    if (!current) return E_INVALID_CONTEXT;
    stream_t *s = calloc(1, sizeof(stream_t));
    if (!s) return E_OUT_OF_MEMORY;
    s->ctx = current;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->thread, NULL, worker, s) != 0) { free(s); return E_OUT_OF_MEMORY; }
    pthread_detach(s->thread);
    *hs = s;
    return OK;
}
CUresult cuStreamDestroy(void *s) { return OK; }  // its worker stays: deviceop never destroys streams
CUresult cuStreamSynchronize(void *hs) {
    stream_t *s = hs;
    if (!s) return E_INVALID_VALUE;
    pthread_mutex_lock(&s->mu);
    while (s->pending) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return sticky;
}
CUresult cuStreamQuery(void *hs) {
    stream_t *s = hs;
    if (sticky) return sticky;
    pthread_mutex_lock(&s->mu);
    long n = s->pending;
    pthread_mutex_unlock(&s->mu);
    return n ? 600 : OK;  // CUDA_ERROR_NOT_READY
}
CUresult cuEventCreate(void **hev, unsigned flags) {
    if (!current) return E_INVALID_CONTEXT;
    event_t *ev = calloc(1, sizeof(event_t));
    if (!ev) return E_OUT_OF_MEMORY;
    ev->ctx = current;
    *hev = ev;
    return OK;
}
CUresult cuEventDestroy(void *hev) {
    event_t *ev = hev;
    pthread_mutex_lock(&ev_mu);
    unref_record(ev->latest);  // queued records and waits keep their own references
    pthread_mutex_unlock(&ev_mu);
    free(ev);
    return OK;
}
CUresult cuEventRecord(void *hev, void *s) {
    event_t *ev = hev;
    void *sctx = ctx_of_stream(s);
    if (sctx && ev->ctx != sctx) return E_INVALID_HANDLE;  // an event of another device
    record_t *r = calloc(1, sizeof(record_t));
    if (!r) return E_OUT_OF_MEMORY;
    r->refs = 2;  // the event's latest, the queued record
    pthread_mutex_lock(&ev_mu);
    unref_record(ev->latest);
    ev->latest = r;
    pthread_mutex_unlock(&ev_mu);
    work_t w = {.kind = W_RECORD, .rec = r};
    CUresult res = submit(s, &w);
    if (res) {  // not queued: it will never complete by itself
        pthread_mutex_lock(&ev_mu);
        r->done = 1;
        unref_record(r);
        pthread_mutex_unlock(&ev_mu);
    }
    return res;
}
CUresult cuStreamWaitEvent(void *s, void *hev, unsigned flags) {
    event_t *ev = hev;
    pthread_mutex_lock(&ev_mu);
    record_t *r = ev->latest;  // the record it waits for: the latest at this call
    if (r) r->refs++;
    pthread_mutex_unlock(&ev_mu);
    if (!r) return OK;  // never recorded: complete
    work_t w = {.kind = W_WAIT, .rec = r};
    CUresult res = submit(s, &w);
    if (res) {
        pthread_mutex_lock(&ev_mu);
        unref_record(r);
        pthread_mutex_unlock(&ev_mu);
    }
    return res;
}
CUresult cuEventQuery(void *hev) {
    event_t *ev = hev;
    if (sticky) return sticky;
    pthread_mutex_lock(&ev_mu);
    int done = !ev->latest || ev->latest->done;
    pthread_mutex_unlock(&ev_mu);
    return done ? OK : 600;
}
CUresult cuEventSynchronize(void *hev) {
    event_t *ev = hev;
    pthread_mutex_lock(&ev_mu);
    record_t *r = ev->latest;
    if (r) {
        r->refs++;
        while (!r->done && !sticky) pthread_cond_wait(&ev_cv, &ev_mu);
        unref_record(r);
    }
    pthread_mutex_unlock(&ev_mu);
    return sticky;
}
// host memory the device may write: device memory is host memory here, so the address is the same
CUresult cuMemHostRegister(void *p, size_t n, unsigned flags) { return p ? OK : E_INVALID_VALUE; }
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned flags) { return cuMemHostRegister(p, n, flags); }
CUresult cuMemHostUnregister(void *p) { return OK; }
CUresult cuMemHostGetDevicePointer(CUdeviceptr *d, void *p, unsigned flags) { *d = (CUdeviceptr)p; return OK; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned flags) { return cuMemHostGetDevicePointer(d, p, flags); }
CUresult cuStreamWriteValue32(void *s, CUdeviceptr addr, uint32_t value, unsigned flags) {
    if (sticky) return sticky;
    int injected = __atomic_exchange_n(&fail_write, 0, __ATOMIC_SEQ_CST);
    if (injected) return injected;
    if (no_memops) return 801;  // CUDA_ERROR_NOT_SUPPORTED
    work_t w = {.kind = W_WRITE32, .dst = addr, .value = value};
    return submit(s, &w);
}
CUresult cuStreamWriteValue32_v2(void *s, CUdeviceptr addr, uint32_t value, unsigned flags) {
    return cuStreamWriteValue32(s, addr, value, flags);
}
CUresult cuLaunchHostFunc(void *s, void (*fn)(void *), void *data) {
    work_t w = {.kind = W_HOSTFN, .hostfn = fn, .data = data};
    return submit(s, &w);
}

// ---- modules and launches --------------------------------------------------------------------
CUresult cuModuleLoadData(void **mod, const void *image) {
    if (!current) return E_INVALID_CONTEXT;
    module_t *m = calloc(1, sizeof(module_t));
    if (!m) return E_OUT_OF_MEMORY;
    m->ctx = current;
    *mod = m;
    return OK;
}
CUresult cuModuleUnload(void *mod) { free(mod); return OK; }
CUresult cuModuleGetFunction(void **fn, void *mod, const char *name) {
    func_t *f = calloc(1, sizeof(func_t));
    if (!f) return E_OUT_OF_MEMORY;
    snprintf(f->name, sizeof f->name, "%s", name);
    f->ctx = ((module_t *)mod)->ctx;
    // without a harness (measuring host cost): every kernel is accepted and does nothing
    f->nparams = nparams_hook ? nparams_hook(name) : 0;
    if (f->nparams < 0 || f->nparams > 32) {
        free(f);
        return E_NOT_FOUND;  // the harness does not know this kernel
    }
    *fn = f;
    return OK;
}
// A launch's arguments as one buffer (extra: CU_LAUNCH_PARAM_BUFFER_POINTER, _SIZE, END), as
// cuBLAS passes its kernels' (at most the 256 bytes of a work item's values)
static CUresult read_extra(void **extra, work_t *w) {
    const void *buf = NULL;
    size_t size = 0;
    for (int j = 0; j < 16 && extra[j] != NULL; j += 2) {
        if ((uintptr_t)extra[j] == 1) buf = extra[j + 1];
        else if ((uintptr_t)extra[j] == 2) size = *(const size_t *)extra[j + 1];
        else return E_INVALID_VALUE;
    }
    if (!buf || size == 0 || size > sizeof w->values) return E_INVALID_VALUE;
    memcpy(w->values, buf, size);
    w->block_bytes = size;
    return OK;
}
CUresult cuLaunchKernel(void *fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shmem, void *s, void **params, void **extra) {
    func_t *f = fn;
    if (sticky) return sticky;
    if (!f || (uint64_t)gx * gy * gz == 0 || (uint64_t)bx * by * bz == 0 || (uint64_t)bx * by * bz > 1024)
        return E_INVALID_VALUE;
    void *sctx = ctx_of_stream(s);
    if (sctx && f->ctx != sctx) return E_INVALID_HANDLE;  // a function of another device's module
    if (sctx && current != sctx) return E_INVALID_CONTEXT;  // launched while another device's context is current
    work_t w = {.kind = W_KERNEL, .fn = f, .nparams = f->nparams, .grid = {gx, gy, gz}, .block = {bx, by, bz}};
    if (params == NULL && extra != NULL) {
        CUresult r = read_extra(extra, &w);
        if (r) return r;
    } else {
        for (int i = 0; i < f->nparams; i++) memcpy(&w.values[i], params[i], 8);
    }
    return submit(s, &w);
}

// ---- graphs ----------------------------------------------------------------------------------
CUresult cuStreamBeginCapture(void *s, int mode) {
    stream_t *st = s;
    if (!st || st->capturing) return E_INVALID_VALUE;
    st->capture = calloc(1, sizeof(graph_t));
    if (!st->capture) return E_OUT_OF_MEMORY;
    st->capturing = 1;
    return OK;
}
CUresult cuStreamEndCapture(void *s, void **graph) {
    stream_t *st = s;
    if (!st || !st->capturing) return E_INVALID_VALUE;
    *graph = st->capture;
    st->capture = NULL;
    st->capturing = 0;
    return OK;
}
CUresult cuStreamIsCapturing(void *s, int *status) {
    stream_t *st = s;
    *status = st && st->capturing;
    return OK;
}
// A captured graph's nodes are its work items (their addresses); an executable made from it keeps
// each item's position (idx), by which cuGraphExecKernelNodeSetParams finds its copy
CUresult cuGraphGetNodes(void *g, void **nodes, size_t *n) {
    graph_t *gr = g;
    if (nodes)
        for (size_t i = 0; i < *n && i < gr->n; i++) nodes[i] = &gr->items[i];
    *n = gr->n;
    return OK;
}
CUresult cuGraphNodeGetType(void *node, int *type) {
    const work_t *w = node;
    *type = w->kind == W_KERNEL ? 0 : w->kind == W_MEMSET ? 2 : w->kind == W_COPY ? 1 : 3;  // KERNEL, MEMSET, MEMCPY, HOST
    return OK;
}
typedef struct {  // CUDA_KERNEL_NODE_PARAMS_v2
    void *func;
    unsigned gx, gy, gz, bx, by, bz, shmem;
    void **kernelParams, **extra;
    void *kern, *ctx;
} kparams_t;
static __thread void *node_params[32];  // what the last query handed out (valid until the next)
static __thread void *node_extra[5];
static __thread size_t node_extra_size;
CUresult cuGraphKernelNodeGetParams(void *node, kparams_t *p) {
    work_t *w = node;
    if (w->kind != W_KERNEL) return E_INVALID_VALUE;
    memset(p, 0, sizeof *p);
    p->func = w->fn;
    p->gx = w->grid[0], p->gy = w->grid[1], p->gz = w->grid[2];
    p->bx = w->block[0], p->by = w->block[1], p->bz = w->block[2];
    p->ctx = w->fn->ctx;
    if (w->block_bytes) {
        node_extra_size = w->block_bytes;
        node_extra[0] = (void *)1, node_extra[1] = w->values, node_extra[2] = (void *)2;
        node_extra[3] = &node_extra_size, node_extra[4] = NULL;
        p->extra = node_extra;
    } else {
        for (int i = 0; i < w->nparams; i++) node_params[i] = &w->values[i];
        p->kernelParams = node_params;
    }
    return OK;
}
CUresult cuFuncGetParamCount(void *fn, size_t *count) {
    func_t *f = fn;
    if (!f) return E_INVALID_VALUE;
    *count = (size_t)f->nparams;
    return OK;
}
CUresult cuFuncGetParamInfo(void *fn, size_t i, size_t *offset, size_t *size) {
    func_t *f = fn;
    if (!f || i >= (size_t)f->nparams) return E_INVALID_VALUE;
    *offset = 8 * i;
    *size = 8;
    return OK;
}
typedef struct {  // CUDA_MEMSET_NODE_PARAMS
    CUdeviceptr dst;
    size_t pitch;
    unsigned value, elementSize;
    size_t width, height;
} msparams_t;
CUresult cuGraphMemsetNodeGetParams(void *node, msparams_t *p) {
    const work_t *w = node;
    if (w->kind != W_MEMSET) return E_INVALID_VALUE;
    p->dst = w->dst, p->pitch = 0, p->value = w->value, p->elementSize = (unsigned)w->width;
    p->width = w->n, p->height = 1;
    return OK;
}
static volatile int fail_update;
// Make the next cuGraphExecKernelNodeSetParams fail with code once (a test's fault switch).
void stub_fail_next_node_update(int code) { __atomic_store_n(&fail_update, code, __ATOMIC_SEQ_CST); }
CUresult cuGraphExecKernelNodeSetParams(void *ex, void *node, const kparams_t *p) {
    graph_t *e = ex;
    const work_t *n = node;
    if (sticky) return sticky;
    int f = __atomic_exchange_n(&fail_update, 0, __ATOMIC_SEQ_CST);
    if (f) return f;
    // a node of the graph the executable was made from, as the driver requires
    if (!e || !n || !e->from || n < e->from->items || n >= e->from->items + e->from->n || n->idx >= e->n)
        return E_INVALID_VALUE;
    work_t *w = &e->items[n->idx];
    if (w->kind != W_KERNEL || p->func != w->fn) return E_INVALID_VALUE;  // (a node keeps its function here)
    work_t upd = *w;
    if (p->kernelParams == NULL && p->extra != NULL) {
        CUresult r = read_extra(p->extra, &upd);
        if (r) return r;
    } else {
        if (!p->kernelParams && w->nparams) return E_INVALID_VALUE;
        for (int i = 0; i < w->nparams; i++) memcpy(&upd.values[i], p->kernelParams[i], 8);
        upd.block_bytes = 0;
    }
    upd.grid[0] = p->gx, upd.grid[1] = p->gy, upd.grid[2] = p->gz;
    upd.block[0] = p->bx, upd.block[1] = p->by, upd.block[2] = p->bz;
    *w = upd;  // (launches already enqueued hold copies: only later ones see it)
    return OK;
}
static graph_t *copy_graph(const graph_t *g) {
    graph_t *c = calloc(1, sizeof(graph_t));
    if (!c) return NULL;
    if (g->n) {
        c->items = malloc(g->n * sizeof(work_t));
        if (!c->items) { free(c); return NULL; }
        memcpy(c->items, g->items, g->n * sizeof(work_t));
    }
    c->n = c->cap = g->n;
    c->from = g;
    return c;
}
static void free_graph(graph_t *g) { if (g) { free(g->items); free(g); } }
CUresult cuGraphInstantiate(void **ex, void *g, unsigned long long flags) {
    *ex = copy_graph(g);
    return *ex ? OK : E_OUT_OF_MEMORY;
}
CUresult cuGraphInstantiateWithFlags(void **ex, void *g, unsigned long long flags) { return cuGraphInstantiate(ex, g, flags); }
CUresult cuGraphUpload(void *ex, void *s) { return OK; }
CUresult cuGraphLaunch(void *ex, void *s) {
    graph_t *g = ex;
    if (sticky) return sticky;
    for (size_t i = 0; i < g->n; i++) {
        CUresult r = submit(s, &g->items[i]);
        if (r) return r;
    }
    return OK;
}
CUresult cuGraphExecUpdate(void *ex, void *g, void *info) {
    graph_t *e = ex, *n = g;
    if (e->n != n->n) return 910;  // CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE
    for (size_t i = 0; i < e->n; i++)
        if (e->items[i].kind != n->items[i].kind) return 910;  // (a kernel node may change its function)
    memcpy(e->items, n->items, n->n * sizeof(work_t));
    return OK;
}
CUresult cuGraphDestroy(void *g) { free_graph(g); return OK; }
CUresult cuGraphExecDestroy(void *ex) { free_graph(ex); return OK; }

// ---- errors ----------------------------------------------------------------------------------
CUresult cuGetErrorName(CUresult e, const char **s) {
    switch (e) {
    case OK: *s = "CUDA_SUCCESS"; break;
    case E_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
    case E_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case E_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
    case 719: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
    case E_CAPTURE_INVALIDATED: *s = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; break;
    default: *s = "CUDA_ERROR_UNKNOWN";
    }
    return OK;
}
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "reported by the deviceop stub driver"; return OK; }

// NVRTC asks the driver it finds for its private tables: there are none here
CUresult cuGetExportTable(const void **table, const void *id) { *table = NULL; return E_NOT_FOUND; }

// cuda.bindings resolves its entry points through cuGetProcAddress: hand out this library's
// (as the driver does, "cuGetProcAddress" asked for CUDA 12 or later is the _v2 entry, which
// reports whether it found the symbol: cuda.bindings calls it so)
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int version, unsigned long long flags, int *status) {
    void *p = dlsym(RTLD_DEFAULT, sym);
    Dl_info here, there;  // only this library's own functions
    if (p && dladdr((void *)cuInit, &here) && dladdr(p, &there) && here.dli_fbase != there.dli_fbase) p = NULL;
    if (p && version >= 12000 && strcmp(sym, "cuGetProcAddress") == 0) p = (void *)cuGetProcAddress_v2;
    *pfn = p;
    if (status != NULL) *status = p != NULL ? 0 : 1;  // CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND
    return p != NULL ? OK : E_NOT_FOUND;
}
CUresult cuGetProcAddress(const char *sym, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(sym, pfn, version, flags, NULL);
}

// A stand-in for cublasLtMatmul, with its signature: one empty kernel ("stub_gemm", its
// arguments one 64-byte buffer, as cuBLAS's kernels take theirs; "stub_gemm_p", eight 8-byte
// parameters, with stub_gemm_by_params(1)) launched on the call's stream,
// so that deviceop's compiled GEMM path, its replay table and its graph launches run without
// cuBLAS, to test them and time their host cost (tests/stub_driver/queue_host_cost.py). A launch hook, where one is set, must know the name.
static func_t stand_in[MAX_DEVICES];  // per context, made once, never freed: work items and graphs point at it
// the same, taking the block's eight words as eight parameters (as cuBLAS's float32 kernels take theirs)
static func_t stand_in_p[MAX_DEVICES];
static pthread_mutex_t stand_in_lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int gemm_by_params;
// Make the stand-in launch its kernel with one parameter per word (on) or one buffer (off, the default).
void stub_gemm_by_params(int on) { __atomic_store_n(&gemm_by_params, on, __ATOMIC_SEQ_CST); }
int stub_ltmatmul(void *h, void *desc, const void *alpha, const void *A, void *Ad, const void *B, void *Bd,
                  const void *beta, const void *C, void *Cd, void *D, void *Dd, const void *algo, void *ws,
                  size_t wsb, void *stream) {
    void *ctx = ctx_of_stream(stream);
    if (!ctx) ctx = current;  // (a legacy stream: the current context's)
    if (!ctx) return 13;      // CUBLAS_STATUS_EXECUTION_FAILED
    int by_params = __atomic_load_n(&gemm_by_params, __ATOMIC_SEQ_CST);
    func_t *f = by_params ? &stand_in_p[(int *)ctx - contexts] : &stand_in[(int *)ctx - contexts];
    pthread_mutex_lock(&stand_in_lock);
    if (f->ctx == NULL) {
        snprintf(f->name, sizeof f->name, by_params ? "stub_gemm_p" : "stub_gemm");
        int n = nparams_hook ? nparams_hook(f->name) : 0;  // (a harness must know the name: 0 if it does)
        f->nparams = n != 0 ? -1 : by_params ? 8 : 0;
        f->ctx = ctx;
    }
    pthread_mutex_unlock(&stand_in_lock);
    if (f->nparams != (by_params ? 8 : 0)) return 13;
    // its argument block, as cuBLAS's kernels take theirs (one buffer): the pointers, D's plus a
    // constant, the workspace and the scalars, so that a replay on other pointers shows in the log
    uint64_t block[8] = {GEMM_MAGIC, (uint64_t)A, (uint64_t)B, (uint64_t)C, (uint64_t)D + 128, (uint64_t)ws, 0, wsb};
    memcpy(&block[6], alpha, 4);
    memcpy((char *)&block[6] + 4, beta, 4);
    if (by_params) {
        void *params[8];
        for (int i = 0; i < 8; i++) params[i] = &block[i];
        return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, params, NULL) ? 13 : 0;
    }
    size_t size = sizeof block;
    void *extra[5] = {(void *)1, block, (void *)2, &size, NULL};
    return cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL, extra) ? 13 : 0;
}
