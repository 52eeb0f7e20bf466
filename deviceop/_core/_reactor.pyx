# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The completion reactor: the GPU writes a flag, one scanner thread wakes the event loops.

An awaited execution arms a *slot*: the stream writes the slot's sequence number into a table
of host memory the device can write (``cuStreamWriteValue32``), in stream order, after the
execution's work. One scanner thread per process watches the armed slots with plain memory
loads (no GIL, no driver call), and pushes each completed slot's token to its event loop's
channel; a channel's eventfd is written once per batch of completions (the channel coalesces).

When to look is learned: per stream, the reactor keeps an estimate of how long an armed
execution takes from the moment it can start (armed, or the previous armed execution on that
stream predicted done). A thread that slept long wakes late (the core it ran on went idle:
tens to hundreds of microseconds on a server), so the reactor also learns that lateness from
its own timed sleeps, and how long a woken loop takes to resume its task. Shortly before the
predicted completion, by the sum of the two, it *pre-wakes* the waiting loop (the token arrives
before the flag is written); the awaiting task then polls the flag in its loop until shortly past
the prediction, awake when the GPU finishes, and parks again if the work runs late. After the
predicted completion the scanner looks at intervals of an eighth of the time waited (at most
1 ms, or 1/32 of the predicted duration); before it, at intervals of a quarter of the time
waited (at most an eighth of the predicted duration), so work that ends well before its
prediction is seen. With nothing armed the scanner parks. A slot armed *unwatched* (by an await
that looks for its completion itself first and retires the slot when it sees it) does not wake
a parked scanner until the task parks (:func:`watch`): a short await costs no wake-up of it.
The CPU policy (:func:`set_policy`):

- ``"adaptive"`` (default): as above; awaiting a 200 ms op costs about 1.5 % of a core, all threads.
- ``"spin"``: the scanner spins while a slot it watches is armed (a core while busy), and
  pre-wakes waiting loops as ``"adaptive"`` does: a loop parked on a long await is woken only
  by the scanner's token, and waking a thread that slept takes tens to hundreds of µs however
  soon the flag is seen.
- ``"block"``: no polling at all: the stream runs a host function that writes the flag and
  wakes the scanner (the driver's thread wakes on the GPU's interrupt; slower wake-ups).

Host functions are also the fallback where the device cannot write the table (stream memory
operations unsupported, or the table cannot be registered), and the host backend's streams
write the flag from their worker thread. When every slot is armed, :func:`arm` returns -1 and
the caller uses the stream's own host-function notification instead.

A context fault stops the device's writes: :func:`fail_context` retires every slot armed on
that device and wakes its waiters (who then see the ``CudaError``); its slots are not reused.
"""

from libc.stdint cimport int32_t, uint32_t, uint64_t, int64_t, uintptr_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memset
from libc.errno cimport ETIMEDOUT
from cpython.exc cimport PyErr_SetFromErrno

from ._base cimport (
    Channel, Driver, chan_push, chan_t, chan_unref, make_current, pthread_mutex_t, pthread_mutex_init,
    pthread_mutex_lock, pthread_mutex_unlock,
)

import os

from .._process import CORE, at_fork_child

__all__ = [
    "arm", "watch", "done", "expected", "prewoken", "overdue", "resumed", "retire", "disown", "fail_context", "set_policy", "policy", "stats", "capacity",
    "Signal", "POLICIES",
]

cdef extern from *:
    """
    #include <time.h>
    #include <pthread.h>
    #include <sys/prctl.h>
    #include <stdint.h>
    static inline uint32_t dvo_load32(uint32_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
    static inline void dvo_store32(uint32_t *p, uint32_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
    static inline int64_t dvo_now_ns(void) {
        struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
        return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    }
    static inline void dvo_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    static pthread_cond_t dvo_cv;
    static int dvo_cv_init(void) {
        pthread_condattr_t a;
        if (pthread_condattr_init(&a)) return -1;
        if (pthread_condattr_setclock(&a, CLOCK_MONOTONIC)) return -1;
        return pthread_cond_init(&dvo_cv, &a);
    }
    static int dvo_cv_wait(pthread_mutex_t *mu, int64_t until_ns) {
        if (until_ns <= 0) return pthread_cond_wait(&dvo_cv, mu);
        struct timespec ts = {until_ns / 1000000000LL, until_ns % 1000000000LL};
        return pthread_cond_timedwait(&dvo_cv, mu, &ts);
    }
    static void dvo_cv_signal(void) { pthread_cond_signal(&dvo_cv); }
    static void dvo_timer_slack(void) {
        prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
        prctl(PR_SET_NAME, (unsigned long)"deviceop-reactor", 0, 0, 0);
    }
    typedef void *(*dvo_thread_fn)(void *);
    static int dvo_start_thread(dvo_thread_fn fn) {
        pthread_t t; pthread_attr_t a;
        if (pthread_attr_init(&a)) return -1;
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        int r = pthread_create(&t, &a, fn, NULL);
        pthread_attr_destroy(&a);
        return r;
    }
    """
    uint32_t dvo_load32(uint32_t* p) nogil
    void dvo_store32(uint32_t* p, uint32_t v) nogil
    int64_t dvo_now_ns() nogil
    void dvo_relax() nogil
    int dvo_cv_init() nogil
    int dvo_cv_wait(pthread_mutex_t* mu, int64_t until_ns) nogil
    void dvo_cv_signal() nogil
    void dvo_timer_slack() nogil
    ctypedef void* (*dvo_thread_fn)(void*) noexcept nogil
    int dvo_start_thread(dvo_thread_fn fn) nogil

cdef extern from "<stdlib.h>" nogil:
    int posix_memalign(void** p, size_t align, size_t n)

cdef enum:
    ADAPTIVE = 0
    SPIN = 1
    BLOCK = 2
POLICIES = ("adaptive", "spin", "block")

cdef enum:
    # nanoseconds
    SPIN_UNKNOWN = 20000      # an execution of a stream not yet measured: spin this long first
    PREWAKE_BASE = 20000      # pre-wake the loop this much + the learned wake-up lateness early
    LATE_BASE = 20000         # first look after the predicted completion (+ est/128)
    POLL_SLACK = 50000        # a pre-woken task polls this much (+ est/64) past the prediction
    LAT_INIT = 100000         # wake-up lateness assumed before any is measured
    LAT_MIN = 5000
    LAT_MAX = 1000000
    BACKOFF_MIN = 20000
    BACKOFF_MAX = 1000000
    NPRED = 256               # streams whose durations are learned (a small hash table)
    NOT_SUPPORTED = 801       # CUDA_ERROR_NOT_SUPPORTED

cdef struct entry_t:
    uint32_t slot
    uint32_t seq
    chan_t* chan       # NULL once nobody waits (cancelled, timed out)
    uint64_t token
    uint64_t key       # the stream's handle: what durations are learned by
    uint64_t ctx       # the device: what a context fault retires
    int64_t armed      # when it was armed
    int64_t start      # when the work is expected to start (armed, or the stream's previous due)
    int64_t due        # predicted completion (0: unknown)
    int64_t wake       # when the scanner looks next
    int64_t hot_until  # spin (look continuously) until then once wake has passed
    int64_t prewake    # push the token then, before completion (0: no pre-wake)
    int64_t pushed     # when the pre-wake token was pushed

cdef struct pred_t:
    uint64_t key
    int64_t est        # learned duration (0: unknown)
    int64_t tail       # predicted completion of the last armed entry on this stream
    int64_t pending

cdef struct hostfn_t:
    uint32_t slot
    uint32_t seq

# the table (allocated once per process; never freed: the device may hold its address)
cdef uint32_t* FLAGS = NULL
cdef uint32_t* SEQ = NULL
cdef uint32_t* FREE = NULL
cdef int NFREE = 0
cdef int NSLOTS = 0
cdef entry_t* E = NULL
cdef int N = 0
# per slot: when a pre-wake was pushed to its await and not yet answered (0: none), and the
# sequence number it was pushed for; outlives the slot's retirement, for :func:`resumed`
cdef int64_t* PUSHED = NULL
cdef uint32_t* PUSHED_SEQ = NULL
# per slot: 1 while someone waits for the scanner's look at it (armed watched, or watched since,
# or disowned); a host function or host stream completing an unwatched slot wakes nobody
cdef unsigned char* WATCHED = NULL
cdef pred_t PRED[NPRED]
cdef pthread_mutex_t MU
cdef bint READY = False
cdef bint STARTED = False
cdef int64_t SLEEPING = 0      # the scanner sleeps until then (-1: parked); 0: awake
cdef int POLICY = ADAPTIVE
cdef int64_t LAT = LAT_INIT    # learned: how late a timed sleep of the scanner ends
cdef int64_t LLAT = LAT_INIT   # learned: how long a pre-woken loop takes to resume its task
# device registration of the table (one, PORTABLE, serves every context)
cdef bint REGISTERED = False
cdef bint MEMOPS = True        # False once the device refused the write or the registration
cdef uintptr_t DADDR = 0
# counters
cdef uint64_t C_ARMED = 0, C_DONE = 0, C_MEMOP = 0, C_HOSTFN = 0, C_HOST = 0, C_EXHAUSTED = 0
cdef uint64_t C_PASSES = 0, C_SLEEPS = 0, C_PARKS = 0, C_FAILED = 0, C_QUARANTINED = 0, C_PREWAKES = 0, C_REARMED = 0
cdef uint64_t C_LATE_RESUMES = 0


cdef int _slots_wanted() except -1:
    v = os.environ.get("DEVICEOP_REACTOR_SLOTS", "").strip()
    if not v:
        return 4096
    try:
        n = int(v)
    except ValueError:
        n = -1
    if not 1 <= n <= 1 << 20:
        from .._errors import SettingError
        raise SettingError(f"DEVICEOP_REACTOR_SLOTS={v!r} is not accepted; use a whole number of slots from 1 to 1048576 (default 4096)")
    return n


cdef int _init() except -1:
    global FLAGS, SEQ, FREE, NFREE, NSLOTS, E, READY, PUSHED, PUSHED_SEQ, WATCHED
    cdef int n = _slots_wanted()
    cdef void* p = NULL
    cdef size_t nbytes = ((<size_t>n * 4 + 4095) // 4096) * 4096
    if posix_memalign(&p, 4096, nbytes) != 0:
        raise MemoryError("deviceop's completion table: out of memory")
    memset(p, 0, nbytes)
    FLAGS = <uint32_t*>p
    SEQ = <uint32_t*>calloc(n, 4)
    FREE = <uint32_t*>malloc(n * 4)
    E = <entry_t*>calloc(n, sizeof(entry_t))
    PUSHED = <int64_t*>calloc(n, sizeof(int64_t))
    PUSHED_SEQ = <uint32_t*>calloc(n, 4)
    WATCHED = <unsigned char*>calloc(n, 1)
    if SEQ == NULL or FREE == NULL or E == NULL or PUSHED == NULL or PUSHED_SEQ == NULL or WATCHED == NULL:
        raise MemoryError("deviceop's completion table: out of memory")
    for i in range(n):
        FREE[i] = n - 1 - i
    NFREE = n
    NSLOTS = n
    memset(PRED, 0, sizeof(PRED))
    pthread_mutex_init(&MU, NULL)
    if dvo_cv_init() != 0:
        PyErr_SetFromErrno(OSError)
    READY = True
    return 0


cdef void _after_fork_child() noexcept nogil:
    # the scanner thread is the parent's; the parent's armed work never completes here
    global N, NFREE, STARTED, SLEEPING, REGISTERED, MEMOPS, DADDR
    cdef int i
    pthread_mutex_init(&MU, NULL)
    dvo_cv_init()
    N = 0
    for i in range(NSLOTS):
        FREE[i] = NSLOTS - 1 - i
        PUSHED[i] = 0
    NFREE = NSLOTS
    memset(PRED, 0, sizeof(PRED))
    STARTED = False
    SLEEPING = 0
    REGISTERED = False
    MEMOPS = True
    DADDR = 0


def _renew_after_fork():
    # (a child made by fork() before the reactor was first used has nothing of it to renew)
    if READY:
        _after_fork_child()


at_fork_child(_renew_after_fork, CORE)


cdef pred_t* _pred(uint64_t key) noexcept nogil:
    cdef uint64_t h = (key * <uint64_t>0x9E3779B97F4A7C15) >> 56
    cdef int i, j
    for i in range(8):
        j = <int>((h + i) & (NPRED - 1))
        if PRED[j].key == key:
            return &PRED[j]
        if PRED[j].key == 0:
            PRED[j].key = key
            return &PRED[j]
    j = <int>(h & (NPRED - 1))  # full neighbourhood: take over the first (an estimate is lost)
    memset(&PRED[j], 0, sizeof(pred_t))
    PRED[j].key = key
    return &PRED[j]


cdef void _learn(entry_t* e, int64_t now, bint precise) noexcept nogil:
    cdef pred_t* p = _pred(e.key)
    cdef int64_t d = now - e.start
    # what the work changed from: the estimate it was armed with (an overdue poll may have
    # raised the stream's since, to the time run so far, which is no prediction)
    cdef int64_t base = e.due - e.start if e.due else p.est
    if p.pending > 0:
        p.pending -= 1
    if p.pending == 0:
        p.tail = 0
    if d <= 0:
        return
    # an observation is an upper bound (the scanner may have looked late): follow it down
    # quickly (three quarters of the way: a stream whose work got ten times shorter is learned
    # in three awaits, not seven, each woken late by the scanner's looks) and up slowly, unless
    # the stream's work changed (four times as long and a millisecond more, which a late look
    # alone does not explain: start over)
    if p.est == 0 or (d > 4 * base and d > base + 1000000):
        p.est = d
    elif d < p.est:
        p.est = d + (p.est - d) // 4
    elif precise:
        # seen by a task polling it (a look every loop turn): no look ended late, so the work
        # took this long; rising by an eighth instead left the next awaits pre-woken early, each
        # polling past its prediction until the estimate caught up
        p.est = d
    else:
        p.est += (d - p.est) // 8


cdef chan_t* _ref(chan_t* c) noexcept nogil:
    pthread_mutex_lock(&c.mu)
    c.refs += 1
    pthread_mutex_unlock(&c.mu)
    return c


cdef void _kick(uint32_t slot) noexcept nogil:
    pthread_mutex_lock(&MU)
    if SLEEPING != 0 and WATCHED[slot]:
        dvo_cv_signal()
    pthread_mutex_unlock(&MU)


cdef void _hostfn_cb(void* ud) noexcept nogil:
    # on the driver's thread: no GIL, no CUDA call
    cdef hostfn_t* h = <hostfn_t*>ud
    cdef uint32_t slot = h.slot
    dvo_store32(&FLAGS[slot], h.seq)
    free(h)
    _kick(slot)


cdef void* _scan_main(void* arg) noexcept nogil:
    global N, NFREE, SLEEPING, C_DONE, C_PASSES, C_SLEEPS, C_PARKS, C_PREWAKES, LAT
    cdef int64_t target, over, cap
    cdef chan_t** bc = <chan_t**>malloc(NSLOTS * sizeof(chan_t*))
    cdef uint64_t* bt = <uint64_t*>malloc(NSLOTS * sizeof(uint64_t))
    cdef int64_t now, next_wake, iv
    cdef int i, j, nb, k
    cdef bint hot
    cdef bint looked = False  # the previous pass ended without a sleep: it looked moments ago
    cdef entry_t* e
    if bc == NULL or bt == NULL:
        return NULL  # arm() sees the scanner did not start: awaits fall back to their re-check
    dvo_timer_slack()  # timed sleeps end within a microsecond of the deadline, not 50
    pthread_mutex_lock(&MU)
    while True:
        if N == 0:
            SLEEPING = -1
            C_PARKS += 1
            dvo_cv_wait(&MU, 0)
            SLEEPING = 0
            looked = False
            continue
        C_PASSES += 1
        now = dvo_now_ns()
        nb = 0
        hot = False
        next_wake = 0
        i = 0
        while i < N:
            e = &E[i]
            if dvo_load32(&FLAGS[e.slot]) == e.seq:
                _learn(e, now, looked)
                if e.chan != NULL:
                    bc[nb] = e.chan
                    bt[nb] = e.token
                    nb += 1
                C_DONE += 1
                FREE[NFREE] = e.slot
                NFREE += 1
                N -= 1
                E[i] = E[N]
                continue
            if POLICY != BLOCK:
                if e.prewake and e.chan == NULL:  # nobody waits any more: nobody to pre-wake
                    e.prewake = 0
                if e.prewake and now >= e.prewake:
                    # wake the loop now: it is awake and polling when the flag is written
                    bc[nb] = e.chan
                    bt[nb] = e.token
                    e.chan = _ref(e.chan)
                    nb += 1
                    e.prewake = 0
                    e.pushed = now
                    PUSHED[e.slot] = now
                    PUSHED_SEQ[e.slot] = e.seq
                    C_PREWAKES += 1
                elif POLICY == SPIN:
                    hot = True
                elif now >= e.wake:
                    if now < e.hot_until:
                        hot = True
                    else:
                        if e.due and now < e.due - _window(e.due - e.start):
                            # before the prediction (work that ends well before it: the stream's
                            # work changed): after a quarter of the time waited so far, at most an
                            # eighth of the predicted duration; each look wakes this thread, and a
                            # long await should cost few of them
                            iv = (now - e.armed) // 4
                            cap = (e.due - e.start) // 8
                        else:  # after an eighth of the time waited so far
                            iv = (now - e.armed) // 8
                            cap = BACKOFF_MAX if e.due == 0 else (e.due - e.start) // 32
                        if cap < BACKOFF_MAX:
                            cap = BACKOFF_MAX
                        if iv < BACKOFF_MIN:
                            iv = BACKOFF_MIN
                        elif iv > cap:
                            iv = cap
                        e.wake = now + iv
                if not hot and (next_wake == 0 or e.wake < next_wake):
                    next_wake = e.wake
                if e.prewake and e.prewake < next_wake:
                    next_wake = e.prewake
            i += 1
        if nb:
            pthread_mutex_unlock(&MU)
            for j in range(nb):
                chan_push(bc[j], bt[j])  # writes the eventfd only when the channel was empty
                chan_unref(bc[j])
            pthread_mutex_lock(&MU)
            looked = True
            continue
        if hot:
            pthread_mutex_unlock(&MU)
            for k in range(32):
                dvo_relax()
            pthread_mutex_lock(&MU)
            looked = True
            continue
        # BLOCK: only a host function's kick wakes the scanner
        SLEEPING = next_wake if POLICY == ADAPTIVE and next_wake > 0 else -1
        target = SLEEPING
        if target > 0 and target <= dvo_now_ns():  # due already: look again at once
            SLEEPING = 0
            looked = True
            continue
        C_SLEEPS += 1
        if dvo_cv_wait(&MU, target if target > 0 else 0) == ETIMEDOUT and target > 0:
            # how late a timed sleep ends: a decaying maximum, so one quick wake does not hide
            # the slow ones of a core that went idle
            _decaying_max(&LAT, dvo_now_ns() - target)
        SLEEPING = 0
        looked = False
    return NULL


cdef class Signal:
    """Completes one armed slot when called: what a host backend's stream runs in stream order."""

    cdef uint32_t slot
    cdef uint32_t seq

    def __call__(self):
        dvo_store32(&FLAGS[self.slot], self.seq)
        _kick(self.slot)


cdef int _claim(uint32_t* slot, uint32_t* seq) except -1:
    """A free slot and its next sequence number; 0 if every slot is armed."""
    global NFREE, STARTED
    if not READY:
        _init()
    pthread_mutex_lock(&MU)
    if not STARTED:
        if dvo_start_thread(_scan_main) != 0:
            pthread_mutex_unlock(&MU)
            PyErr_SetFromErrno(OSError)
        STARTED = True
    if NFREE == 0:
        pthread_mutex_unlock(&MU)
        return 0
    NFREE -= 1
    slot[0] = FREE[NFREE]
    SEQ[slot[0]] += 1
    if SEQ[slot[0]] == 0:  # 0 is what an unused slot holds
        SEQ[slot[0]] = 1
    seq[0] = SEQ[slot[0]]
    pthread_mutex_unlock(&MU)
    return 1


cdef void _unclaim(uint32_t slot) noexcept nogil:
    global NFREE
    pthread_mutex_lock(&MU)
    FREE[NFREE] = slot
    NFREE += 1
    pthread_mutex_unlock(&MU)


cdef int _write(Driver d, uintptr_t stream, uint32_t slot, uint32_t seq) except -1:
    """Enqueue the flag write on a driver's stream: a memory operation, else a host function."""
    global REGISTERED, MEMOPS, DADDR, C_MEMOP, C_HOSTFN
    cdef int err
    cdef hostfn_t* h
    make_current(d)
    if MEMOPS and POLICY != BLOCK and d.write_value32 != NULL:
        if not REGISTERED:
            err = d.host_register(FLAGS, ((<size_t>NSLOTS * 4 + 4095) // 4096) * 4096, &DADDR)
            if err:
                MEMOPS = False  # the table cannot be mapped: host functions from now on
            REGISTERED = True
        if MEMOPS:
            err = d.write_value32(<void*>stream, DADDR + 4 * slot, seq)
            if not err:
                C_MEMOP += 1
                return 0
            if err != NOT_SUPPORTED:
                raise d.error(err, "cuStreamWriteValue32")
            MEMOPS = False
    h = <hostfn_t*>malloc(sizeof(hostfn_t))
    if h == NULL:
        raise MemoryError()
    h.slot = slot
    h.seq = seq
    err = d.host_func(<void*>stream, _hostfn_cb, h)
    if err:
        free(h)
        raise d.error(err, "cuLaunchHostFunc")
    C_HOSTFN += 1
    return 0


cpdef long long arm(object stream, Channel ch, uint64_t token, bint watch=True) except? -2:
    """Arm a slot after the work enqueued on ``stream`` so far: once the stream passes this
    point, ``token`` is pushed to ``ch``. Returns the slot's handle, or -1 if every slot is
    armed (use the stream's own notification then).

    ``watch=False``: the caller looks for the completion itself first (a task polling in its
    event loop, which then retires the slot): a scanner thread that is parked is not woken
    for this slot until :func:`watch` (the task parks) or :func:`disown`. Most short awaits
    then complete without waking it (a futex wake-up per await, and the scanner's pass)."""
    global N, C_ARMED, C_HOST, C_EXHAUSTED
    cdef uint32_t slot = 0, seq = 0
    cdef Signal sig
    cdef object be = stream.backend
    cdef object drv = be.driver
    cdef uint64_t key = <uint64_t>stream.handle_int
    cdef int64_t now, start, est
    cdef pred_t* p
    cdef entry_t* e
    if not _claim(&slot, &seq):
        C_EXHAUSTED += 1
        return -1
    WATCHED[slot] = watch  # (before the write: its host function may run at once)
    try:
        if drv is not None:
            _write(<Driver>drv, <uintptr_t>stream.handle_int, slot, seq)
        else:
            sig = Signal.__new__(Signal)
            sig.slot = slot
            sig.seq = seq
            stream.signal(sig)
            C_HOST += 1
    except BaseException:
        _unclaim(slot)
        raise
    cdef chan_t* c = ch.ref()
    pthread_mutex_lock(&MU)
    now = dvo_now_ns()
    p = _pred(key)
    start = p.tail if p.pending > 0 and p.tail > now else now
    est = p.est
    e = &E[N]
    N += 1
    e.slot = slot
    PUSHED[slot] = 0
    e.seq = seq
    e.chan = c
    e.token = token
    e.key = key
    e.ctx = <uint64_t>id(be)
    e.armed = now
    e.start = start
    e.prewake = 0
    if est > 0:
        e.due = start + est
        if POLICY != BLOCK and e.due - _window(est) > now:
            e.prewake = e.due - _window(est)
        # besides the pre-wake, the scanner looks on its backing-off schedule from the start:
        # work that ends well before its prediction (the stream's work changed) is seen too
        e.wake = now + BACKOFF_MIN
        e.hot_until = now  # the loop polls around the completion; the scanner never spins
        p.tail = e.due
    else:
        e.due = 0
        e.wake = now
        e.hot_until = now + SPIN_UNKNOWN
        p.tail = now
    p.pending += 1
    C_ARMED += 1
    if watch:
        _wake_for(e)
    pthread_mutex_unlock(&MU)
    return (<uint64_t>slot << 32) | seq


cdef inline void _watch(entry_t* e) noexcept nogil:
    """From now on the scanner looks after ``e`` (its host function's kick wakes it too), woken
    now if it would not look in time. Call with ``MU`` held."""
    WATCHED[e.slot] = 1
    _wake_for(e)


cdef inline void _wake_for(entry_t* e) noexcept nogil:
    """Wake the scanner if it would not look at ``e`` in time (parked, or asleep past its next
    look or pre-wake). Call with ``MU`` held."""
    cdef int64_t t = e.wake
    if e.prewake and e.prewake < t:
        t = e.prewake
    if SLEEPING == -1 or (SLEEPING > 0 and t < SLEEPING):
        dvo_cv_signal()


cpdef int watch(uint64_t handle) except -1:
    """The task that armed ``handle`` with ``watch=False`` now waits for the reactor (it parks):
    the scanner looks after the slot from now on, woken if it would not look in time."""
    cdef entry_t* e
    if not READY:
        return 0
    pthread_mutex_lock(&MU)
    e = _armed(handle)
    if e != NULL:
        _watch(e)
    pthread_mutex_unlock(&MU)
    return 0


cdef inline int64_t _window(int64_t est) noexcept nogil:
    # a pre-wake's lead on the predicted completion: the scanner's timed sleep may end LAT late,
    # and the woken loop resumes its task LLAT after the push
    return LAT + LLAT + PREWAKE_BASE + est // 4096


cdef void _decaying_max(int64_t* v, int64_t x) noexcept nogil:
    # one quick wake-up must not hide the slow ones of a core that went idle
    if x > v[0]:
        v[0] = x if x < LAT_MAX else LAT_MAX
    else:
        v[0] -= (v[0] - x) // 16
        if v[0] < LAT_MIN:
            v[0] = LAT_MIN


cdef entry_t* _armed(uint64_t handle) noexcept nogil:
    """The armed entry of ``handle`` (the slot and its sequence number), or NULL once retired.
    Call with ``MU`` held."""
    cdef uint32_t slot = <uint32_t>(handle >> 32)
    cdef uint32_t seq = <uint32_t>handle  # (the low 32 bits)
    cdef int i
    for i in range(N):
        if E[i].slot == slot and E[i].seq == seq:
            return &E[i]
    return NULL


def prewoken(uint64_t handle):
    """Called by a parked task that woke before its work completed (its pre-wake, or its
    re-check timer near the predicted completion): learns how long the loop took to resume it
    after a pre-wake, and returns how long to poll: until the predicted completion plus a
    margin for work that runs a little long (50 µs + 1/64 of its duration). None: nothing to
    poll for (the slot is no longer armed, its duration is not known, or the completion is
    farther off than a pre-wake's window: the pre-wake comes later; a pre-wake that came far
    earlier than planned is armed again)."""
    global C_REARMED
    cdef entry_t* e
    cdef int64_t now, est
    cdef bint pre
    r = None
    pthread_mutex_lock(&MU)
    now = dvo_now_ns()
    e = _armed(handle)
    if e != NULL:
        pre = e.pushed != 0
        if pre:
            _decaying_max(&LLAT, now - e.pushed)
            e.pushed = 0
            PUSHED[e.slot] = 0
        if e.due:
            est = _pred(e.key).est
            # a pre-wake comes early by up to its lead (the scanner's sleep may end on time,
            # and the loop resume at once), and the learned lateness may have fallen since
            # the slot was armed: a pre-woken task polls from then
            if e.due - now > _window(est) + (LAT_MAX if pre else 0):
                # woken well before the completion (by the timer, or that pre-wake): park again
                if pre and POLICY != BLOCK:
                    # far earlier than planned: without a pre-wake still to come, only a
                    # backing-off look would end the park
                    e.prewake = e.due - _window(est)
                    C_REARMED += 1
                    if SLEEPING == -1 or (SLEEPING > 0 and e.prewake < SLEEPING):
                        dvo_cv_signal()
            else:
                # polled from now on: a pre-wake still to come would only wake the task again
                e.prewake = 0
                r = ((e.due - now if e.due > now else 0) + POLL_SLACK + est // 64) * 1e-9
                # the scanner looks again once the task stops polling
                e.wake = e.due + POLL_SLACK + est // 64
                e.hot_until = e.wake + LATE_BASE + est // 128
    pthread_mutex_unlock(&MU)
    return r


cdef inline bint _written(uint32_t slot, uint32_t seq) noexcept nogil:
    # at or past seq: once the scanner retires a slot it is armed again with the next number,
    # and that write may land before the first owner looks (a polling task between two
    # checks); a slot is only reused after its write landed, so its writes come in order
    return <int32_t>(dvo_load32(&FLAGS[slot]) - seq) >= 0


cpdef bint done(uint64_t handle) except -1:
    """True once the slot's flag was written (the work before it completed)."""
    cdef uint32_t slot = <uint32_t>(handle >> 32)
    if slot >= <uint32_t>NSLOTS:
        raise ValueError(f"not a reactor handle: {handle}")
    return _written(slot, <uint32_t>(handle & 0xFFFFFFFF))


def expected(uint64_t handle):
    """How the task that armed ``handle`` should wait, and whether its slot is the only one
    armed (no other await's work pending in the process): ``(when, alone)``. ``when``: -1.0 if
    its stream's durations are not known yet (or the slot is no longer armed); 0.0 if the
    reactor will pre-wake it (park); otherwise the seconds until the predicted completion, too
    soon for a pre-wake (poll)."""
    cdef entry_t* e
    cdef double r = -1.0
    cdef bint alone = False
    cdef int64_t now
    pthread_mutex_lock(&MU)
    e = _armed(handle)
    if e != NULL:
        alone = N == 1
        if e.due:
            now = dvo_now_ns()
            if e.prewake or e.due - now > _window(_pred(e.key).est):
                r = 0.0
            else:
                r = (e.due - now) * 1e-9 if e.due > now else 1e-9
    pthread_mutex_unlock(&MU)
    return r, alone


def overdue(uint64_t handle):
    """Called by a task whose poll after a pre-wake ran out before its work completed: the
    stream's work takes at least as long as this one has run so far, and the estimate rises to
    that at once. Observations only ever raised it by an eighth per await (they are upper
    bounds), so an estimate that fell too low (a first await armed late after its launch, or
    work that grew) took many awaits to recover, each parked past its completion."""
    cdef entry_t* e
    cdef int64_t lb
    cdef pred_t* p
    pthread_mutex_lock(&MU)
    e = _armed(handle)
    if e != NULL:
        p = _pred(e.key)
        lb = dvo_now_ns() - e.start
        if lb > p.est:
            p.est = lb
    pthread_mutex_unlock(&MU)


def resumed(uint64_t handle):
    """Called by a parked task that woke to find its work complete. If the reactor had pre-woken
    it and it had not answered (:func:`prewoken`) by then, the loop resumed it too late to poll:
    learn that lateness (now since the pre-wake), so later pre-wakes come that much earlier.
    Only answered pre-wakes were learned before, so the lead followed the quick resumes alone
    and missed the slow ones again and again."""
    global C_LATE_RESUMES
    cdef uint32_t slot = <uint32_t>(handle >> 32)
    cdef uint32_t seq = <uint32_t>(handle & 0xFFFFFFFF)
    cdef int64_t t
    if slot >= <uint32_t>NSLOTS or PUSHED == NULL:
        return
    pthread_mutex_lock(&MU)
    t = PUSHED[slot]
    if t != 0 and PUSHED_SEQ[slot] == seq:
        _decaying_max(&LLAT, dvo_now_ns() - t)
        PUSHED[slot] = 0
        C_LATE_RESUMES += 1
    pthread_mutex_unlock(&MU)


cpdef bint retire(uint64_t handle, bint polled=False) except -1:
    """The awaiting task saw the flag: retire the slot now (learning the duration from that
    moment) rather than at the scanner's next look. ``polled``: the task saw it while polling
    (looking every loop turn), so the moment is the completion's, give or take a loop turn.
    Returns False if the flag is not written yet (then :func:`disown` it)."""
    global N, NFREE, C_DONE
    cdef uint32_t slot = <uint32_t>(handle >> 32)
    cdef uint32_t seq = <uint32_t>(handle & 0xFFFFFFFF)
    cdef chan_t* c = NULL
    cdef entry_t* e
    if slot >= <uint32_t>NSLOTS or not _written(slot, seq):
        return False
    pthread_mutex_lock(&MU)
    e = _armed(handle)
    if e != NULL:
        _learn(e, dvo_now_ns(), polled)
        c = e.chan
        FREE[NFREE] = slot
        NFREE += 1
        N -= 1
        e[0] = E[N]
        C_DONE += 1
    pthread_mutex_unlock(&MU)
    if c != NULL:
        chan_unref(c)
    return True


cpdef int disown(uint64_t handle) except -1:
    """Nobody waits for this slot any more (cancelled, timed out): its token is not pushed.
    The slot stays armed until the device writes it, so it is never reused early."""
    cdef chan_t* c = NULL
    cdef entry_t* e
    if not READY:
        return 0
    pthread_mutex_lock(&MU)
    e = _armed(handle)
    if e != NULL:
        c = e.chan
        e.chan = NULL
        _watch(e)  # (armed unwatched: the scanner retires the slot once it is written)
    pthread_mutex_unlock(&MU)
    if c != NULL:
        chan_unref(c)
    return 0


def fail_context(backend):
    """``backend``'s context failed: retire every slot armed on it and wake their waiters (who
    then see the error). Those slots are not reused: the device never wrote them."""
    global N, C_FAILED, C_QUARANTINED
    cdef uint64_t ctx = <uint64_t>id(backend)
    cdef int i = 0, nb = 0, j
    cdef chan_t** bc
    cdef uint64_t* bt
    if not READY:
        return 0
    bc = <chan_t**>malloc(NSLOTS * sizeof(chan_t*))
    bt = <uint64_t*>malloc(NSLOTS * sizeof(uint64_t))
    if bc == NULL or bt == NULL:
        free(bc)
        free(bt)
        raise MemoryError()
    pthread_mutex_lock(&MU)
    while i < N:
        if E[i].ctx == ctx:
            if E[i].chan != NULL:
                bc[nb] = E[i].chan
                bt[nb] = E[i].token
                nb += 1
            _learn(&E[i], 0, False)
            C_QUARANTINED += 1
            N -= 1
            E[i] = E[N]
            continue
        i += 1
    C_FAILED += nb
    pthread_mutex_unlock(&MU)
    for j in range(nb):
        chan_push(bc[j], bt[j])
        chan_unref(bc[j])
    free(bc)
    free(bt)
    return nb


def set_policy(str name):
    """How the scanner waits while work is armed: ``"adaptive"`` (default), ``"spin"`` or
    ``"block"`` (see the module docstring). Slots armed already keep their mode of writing."""
    global POLICY
    if name not in POLICIES:
        from .._errors import SettingError
        raise SettingError(f"wait policy {name!r} is not one of {POLICIES}; the default is 'adaptive'")
    if not READY:
        _init()
    pthread_mutex_lock(&MU)
    POLICY = POLICIES.index(name)
    dvo_cv_signal()
    pthread_mutex_unlock(&MU)


def policy():
    """The scanner's CPU policy (see :func:`set_policy`)."""
    return POLICIES[POLICY]


def capacity():
    """The number of slots (``DEVICEOP_REACTOR_SLOTS``, default 4096)."""
    if not READY:
        _init()
    return NSLOTS


def stats():
    """Counters: slots armed and completed, by how the flag was written, fallbacks, the
    scanner's passes, sleeps and parks, and what is armed now."""
    if not READY:
        _init()
    pthread_mutex_lock(&MU)
    out = {
        "armed": C_ARMED, "completed": C_DONE, "memop": C_MEMOP, "host_function": C_HOSTFN,
        "host_stream": C_HOST, "exhausted": C_EXHAUSTED, "failed": C_FAILED, "quarantined": C_QUARANTINED,
        "passes": C_PASSES, "sleeps": C_SLEEPS, "parks": C_PARKS, "prewakes": C_PREWAKES, "rearmed": C_REARMED,
        "late_resumes": C_LATE_RESUMES,
        "wake_lateness_s": LAT * 1e-9, "loop_lateness_s": LLAT * 1e-9, "pending": N, "free": NFREE,
        "slots": NSLOTS, "policy": POLICIES[POLICY], "memops": bool(MEMOPS), "scanner": bool(STARTED),
    }
    pthread_mutex_unlock(&MU)
    return out


def _estimates():
    """Learned durations in seconds, by stream handle (diagnostics and tests)."""
    cdef int i
    out = {}
    pthread_mutex_lock(&MU)
    for i in range(NPRED):
        if PRED[i].key and PRED[i].est:
            out[PRED[i].key] = PRED[i].est * 1e-9
    pthread_mutex_unlock(&MU)
    return out


def _prediction(uint64_t key):
    """``(estimate s, awaits pending, predicted end of the last one s from now)`` for stream
    handle ``key``, or None (diagnostics)."""
    cdef int i
    r = None
    pthread_mutex_lock(&MU)
    for i in range(NPRED):
        if PRED[i].key == key:
            r = (PRED[i].est * 1e-9, PRED[i].pending, (PRED[i].tail - dvo_now_ns()) * 1e-9 if PRED[i].tail else None)
            break
    pthread_mutex_unlock(&MU)
    return r


_env = os.environ.get("DEVICEOP_WAIT_POLICY", "").strip()
if _env:
    if _env not in POLICIES:
        from .._errors import SettingError
        raise SettingError(f"DEVICEOP_WAIT_POLICY={_env!r} is not accepted; use one of {POLICIES} (default 'adaptive')")
    set_policy(_env)
