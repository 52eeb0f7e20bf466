/* deviceop._native: the places where Python is too slow or must not run.
 *
 * 1. Launch paths: launch() (cuLaunchKernel with a geometry packed once per plan),
 *    run_planned() (a planned elementwise launch: parameter check, ledger "already held"
 *    check and launch under the ledger lock, in one call), run_steps() (the step loop of a
 *    then/map chain, which launches planned calls directly), lt_matmul() (cublasLtMatmul),
 *    graph_launch(), event_record/event_query(), stream_sync(). cuda.bindings spends about as
 *    long converting its arguments as the driver spends launching; here callers pass plain
 *    integers prepared once.
 *    Their attribute reads go through slot sites (sget/sset): a cached offset into the
 *    __slots__ of the one type each site sees.
 * 2. Lock: the ledger lock (a POSIX semaphore), which these paths take without a Python
 *    method call, and the ledger's release of a finished execution (ledger_release).
 * 2b. Graph replays: GraphBase.launch() and ReplayBase.sync()/sync_on(), the base classes of
 *    CudaGraph and its launch op: one replay and its wait in one call (replay_core).
 * 3. Channel + notify(): completion wake-ups for `await`. notify() enqueues a C host function
 *    with cuLaunchHostFunc; when the stream reaches it, the function (on the driver's thread,
 *    without the GIL, without any CUDA call) appends a token to the channel's queue and
 *    writes the channel's eventfd. The event loop watches the fd and drains the tokens.
 *
 * The driver is not linked: its entry points are looked up with dlsym in the libcuda that
 * cuda.bindings already loaded (load_driver), and cublasLtMatmul's address comes from the
 * library nvmath loaded, so importing this module never needs a GPU.
 */
#include "_native.h"
#include "structmember.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/eventfd.h>
#endif

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*hostfunc_fn)(void *, void (*)(void *), void *);
typedef int (*graphlaunch_fn)(void *, void *);
typedef int (*evrecord_fn)(void *, void *);
typedef int (*evquery_fn)(void *);
typedef int (*ssync_fn)(void *);
typedef int (*ctxget_fn)(void **);
typedef int (*ctxset_fn)(void *);
/* cublasLtMatmul(handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, ws, wsSize, stream) */
typedef int (*ltmatmul_fn)(void *, void *, const void *, const void *, void *, const void *, void *,
                           const void *, const void *, void *, void *, void *, const void *, void *,
                           size_t, void *);

/* 1 (with RuntimeError set) if a driver entry point was not found: load_driver() first */
static int driver_missing(const void *p) {
    if (p != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the CUDA driver is not loaded; call load_driver() first");
    return 1;
}

static launch_fn p_launch = NULL;
static hostfunc_fn p_hostfunc = NULL;
static graphlaunch_fn p_graph_launch = NULL;
static evrecord_fn p_ev_record = NULL;
static evquery_fn p_ev_query = NULL;
static ssync_fn p_stream_sync = NULL;
static ctxget_fn p_ctx_get = NULL;
static ctxset_fn p_ctx_set = NULL;

/* ---- channel: a token queue plus a wake-up fd, shared with host functions ----------------- */

typedef struct chan {
    pthread_mutex_t mu;
    int rfd, wfd;        /* eventfd: rfd == wfd; pipe elsewhere */
    uint64_t *buf;
    size_t n, cap;
    long refs;           /* the Python owner + every pending host function */
} chan;

static void chan_unref_locked(chan *c, int *freed) {
    *freed = 0;
    if (--c->refs == 0) {
        *freed = 1;
    }
}

static void chan_free(chan *c) {
    if (c->rfd >= 0) close(c->rfd);
    if (c->wfd >= 0 && c->wfd != c->rfd) close(c->wfd);
    free(c->buf);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* push a token and wake the reader if the queue was empty; returns 0 or an errno */
static int chan_push(chan *c, uint64_t token) {
    pthread_mutex_lock(&c->mu);
    if (c->n == c->cap) {
        size_t cap = c->cap ? c->cap * 2 : 64;
        uint64_t *nb = (uint64_t *)realloc(c->buf, cap * sizeof(uint64_t));
        if (nb == NULL) {
            pthread_mutex_unlock(&c->mu);
            return ENOMEM;
        }
        c->buf = nb;
        c->cap = cap;
    }
    c->buf[c->n++] = token;
    if (c->n == 1) {
        uint64_t one = 1;
        ssize_t w;
        do {
            w = write(c->wfd, &one, sizeof one);
        } while (w < 0 && errno == EINTR);
        /* EAGAIN: the counter is already non-zero, so the reader will wake anyway */
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

typedef struct {
    chan *c;
    uint64_t token;
} note;

/* the host function: runs on the driver's thread; no GIL, no CUDA calls */
static void notify_cb(void *ud) {
    note *nt = (note *)ud;
    chan *c = nt->c;
    int freed;
    chan_push(c, nt->token);
    pthread_mutex_lock(&c->mu);
    chan_unref_locked(c, &freed);
    pthread_mutex_unlock(&c->mu);
    if (freed) chan_free(c);
    free(nt);
}

typedef struct {
    PyObject_HEAD
    chan *c;
} Channel;

static int Channel_init(Channel *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, ":Channel", kwlist)) return -1;
    if (self->c != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Channel is already initialised; make a new one");
        return -1;
    }
    chan *c = (chan *)calloc(1, sizeof(chan));
    if (c == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&c->mu, NULL);
#ifdef __linux__
    c->rfd = c->wfd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (c->rfd < 0) {
#else
    {
#endif
        int p[2];
        if (pipe(p) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            pthread_mutex_destroy(&c->mu);
            free(c);
            return -1;
        }
        fcntl(p[0], F_SETFL, O_NONBLOCK);
        fcntl(p[1], F_SETFL, O_NONBLOCK);
        c->rfd = p[0];
        c->wfd = p[1];
    }
    c->refs = 1;
    self->c = c;
    return 0;
}

static void Channel_dealloc(Channel *self) {
    chan *c = self->c;
    if (c != NULL) {
        int freed;
        pthread_mutex_lock(&c->mu);
        chan_unref_locked(c, &freed);
        pthread_mutex_unlock(&c->mu);
        /* host functions still pending keep the fd open, so they never write to a reused fd */
        if (freed) chan_free(c);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static chan *need(Channel *self) {
    if (self->c == NULL) PyErr_SetString(PyExc_ValueError, "Channel was not initialised");
    return self->c;
}

static PyObject *Channel_fileno(Channel *self, PyObject *unused) {
    chan *c = need(self);
    if (c == NULL) return NULL;
    return PyLong_FromLong(c->rfd);
}

static PyObject *Channel_push(Channel *self, PyObject *arg) {
    chan *c = need(self);
    if (c == NULL) return NULL;
    unsigned long long token = PyLong_AsUnsignedLongLong(arg);
    if (token == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    int rc = chan_push(c, token);
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

/* reset the fd first, then take the queue: a push racing with us either lands in what we
 * take or re-arms the fd; a wake-up is never lost (at worst one is spurious) */
static PyObject *Channel_drain(Channel *self, PyObject *unused) {
    chan *c = need(self);
    if (c == NULL) return NULL;
    char sink[64];
    ssize_t r;
    do {
        r = read(c->rfd, sink, sizeof sink);
    } while (r > 0 && c->rfd != c->wfd);
    pthread_mutex_lock(&c->mu);
    size_t n = c->n;
    uint64_t small[64];
    uint64_t *copy = small;
    if (n > 64) {
        copy = (uint64_t *)malloc(n * sizeof(uint64_t));
        if (copy == NULL) {
            pthread_mutex_unlock(&c->mu);
            return PyErr_NoMemory();
        }
    }
    if (n) memcpy(copy, c->buf, n * sizeof(uint64_t));
    c->n = 0;
    pthread_mutex_unlock(&c->mu);
    PyObject *out = PyList_New((Py_ssize_t)n);
    if (out != NULL) {
        for (size_t i = 0; i < n; i++) {
            PyObject *v = PyLong_FromUnsignedLongLong(copy[i]);
            if (v == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, (Py_ssize_t)i, v);
        }
    }
    if (copy != small) free(copy);
    return out;
}

/* notify(stream_handle, token): enqueue the host function that pushes ``token`` when the
 * stream reaches this point. Returns the CUresult (0 on success). */
static PyObject *Channel_notify(Channel *self, PyObject *const *args, Py_ssize_t nargs) {
    chan *c = need(self);
    if (c == NULL) return NULL;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "notify(stream_handle, token) takes 2 arguments");
        return NULL;
    }
    if (driver_missing(p_hostfunc)) return NULL;
    void *stream = PyLong_AsVoidPtr(args[0]);
    unsigned long long token = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    note *nt = (note *)malloc(sizeof(note));
    if (nt == NULL) return PyErr_NoMemory();
    nt->c = c;
    nt->token = token;
    pthread_mutex_lock(&c->mu);
    c->refs++;
    pthread_mutex_unlock(&c->mu);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = p_hostfunc(stream, notify_cb, nt);
    Py_END_ALLOW_THREADS
    if (err != 0) { /* never enqueued: undo */
        int freed;
        pthread_mutex_lock(&c->mu);
        chan_unref_locked(c, &freed);
        pthread_mutex_unlock(&c->mu);
        if (freed) chan_free(c);
        free(nt);
    }
    return PyLong_FromLong(err);
}

static PyMethodDef Channel_methods[] = {
    {"fileno", (PyCFunction)Channel_fileno, METH_NOARGS, "The fd to watch for readability."},
    {"push", (PyCFunction)Channel_push, METH_O, "push(token): queue a token and wake the reader (any thread)."},
    {"drain", (PyCFunction)Channel_drain, METH_NOARGS, "drain() -> list of tokens pushed since the last drain."},
    {"notify", (PyCFunction)(void (*)(void))Channel_notify, METH_FASTCALL,
     "notify(stream_handle, token) -> CUresult: push token when the stream gets here."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deviceop._native.Channel",
    .tp_basicsize = sizeof(Channel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A wake-up channel: tokens pushed by host functions (no GIL) or Python, drained by the event loop.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Channel_init,
    .tp_dealloc = (destructor)Channel_dealloc,
    .tp_methods = Channel_methods,
};


/* ---- Lock: the ledger lock, takeable from C without a method call ---------------------- */

/* A POSIX semaphore rather than a PyThread lock: taking a PyThread lock reads the monotonic
 * clock even when it does not wait (CPython 3.11/3.12 compute a deadline first), which is a
 * measurable share of a graph replay that takes this lock twice. Any thread may give it back,
 * as with threading.Lock. */
typedef struct {
    PyObject_HEAD
    sem_t sem;
    int ready;
    int locked;
} LockObject;

static PyTypeObject LockType;

/* Take the lock with the GIL held; waits (GIL released) if another thread has it. */
static int lock_take(LockObject *l) {
    if (sem_trywait(&l->sem) != 0) {
        int r;
        Py_BEGIN_ALLOW_THREADS
        do r = sem_wait(&l->sem);
        while (r != 0 && errno == EINTR);
        Py_END_ALLOW_THREADS
        if (r != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    l->locked = 1;
    return 0;
}

/* give back a lock this code took (cannot fail; leaves any error set; no GIL needed) */
static inline void lock_drop(LockObject *l) {
    l->locked = 0;
    sem_post(&l->sem);
}

static int lock_give(LockObject *l) {
    if (!l->locked) {
        PyErr_SetString(PyExc_RuntimeError, "release of an unlocked lock");
        return -1;
    }
    lock_drop(l);
    return 0;
}

static PyObject *Lock_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    LockObject *self = (LockObject *)PyType_GenericNew(type, args, kw);
    if (self != NULL) {
        if (sem_init(&self->sem, 0, 1) != 0) {
            Py_DECREF(self);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        self->ready = 1;
    }
    return (PyObject *)self;
}

static void Lock_dealloc(LockObject *self) {
    if (self->ready) sem_destroy(&self->sem);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Lock_acquire(LockObject *self, PyObject *unused) {
    if (lock_take(self) < 0) return NULL;
    Py_RETURN_TRUE;
}

static PyObject *Lock_release(LockObject *self, PyObject *unused) {
    if (lock_give(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Lock_exit(LockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (lock_give(self) < 0) return NULL;
    Py_RETURN_FALSE;
}

static PyObject *Lock_locked(LockObject *self, PyObject *unused) { return PyBool_FromLong(self->locked); }

static PyMethodDef Lock_methods[] = {
    {"acquire", (PyCFunction)Lock_acquire, METH_NOARGS, "acquire() -> True: take the lock, waiting if needed."},
    {"release", (PyCFunction)Lock_release, METH_NOARGS, "release(): give the lock back."},
    {"locked", (PyCFunction)Lock_locked, METH_NOARGS, "locked() -> bool."},
    {"__enter__", (PyCFunction)Lock_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Lock_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deviceop._native.Lock",
    .tp_basicsize = sizeof(LockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A non-reentrant lock like threading.Lock, which native launch paths take without a method call.",
    .tp_new = Lock_new,
    .tp_dealloc = (destructor)Lock_dealloc,
    .tp_methods = Lock_methods,
};

/* ---- the driver ------------------------------------------------------------------------ */

static PyObject *load_driver(PyObject *self, PyObject *unused) {
    if (p_launch != NULL && p_hostfunc != NULL) Py_RETURN_TRUE;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h == NULL) Py_RETURN_FALSE;
    p_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
    p_hostfunc = (hostfunc_fn)dlsym(h, "cuLaunchHostFunc");
    p_graph_launch = (graphlaunch_fn)dlsym(h, "cuGraphLaunch");
    p_ev_record = (evrecord_fn)dlsym(h, "cuEventRecord");
    p_ev_query = (evquery_fn)dlsym(h, "cuEventQuery");
    p_stream_sync = (ssync_fn)dlsym(h, "cuStreamSynchronize");
    p_ctx_get = (ctxget_fn)dlsym(h, "cuCtxGetCurrent");
    p_ctx_set = (ctxset_fn)dlsym(h, "cuCtxSetCurrent");
    if (p_launch == NULL || p_hostfunc == NULL || p_graph_launch == NULL || p_ev_record == NULL || p_ev_query == NULL ||
        p_stream_sync == NULL || p_ctx_get == NULL || p_ctx_set == NULL) {
        p_launch = NULL;
        p_hostfunc = NULL;
        p_graph_launch = NULL;
        p_ev_record = NULL;
        p_ev_query = NULL;
        p_stream_sync = NULL;
        p_ctx_get = NULL;
        p_ctx_set = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---- slot reads: the launch path's attribute accesses --------------------------------- */

/* One attribute access site with a one-entry cache of where the slot lives in the last type
 * seen: these sites see one type each (Tensor, Buffer, ...), so the read is a load instead of
 * a generic attribute lookup. The type's version tag revalidates the cache if the class
 * changes; anything that is not a plain __slots__ member takes the generic path. */
typedef struct {
    const char *cname;
    PyObject *name;      /* interned on first use */
    PyTypeObject *type;  /* strong reference: the address cannot be reused by another type */
    unsigned int tag;
    Py_ssize_t off;      /* 0: not a slot of this type, use the generic path */
} slot_site;

#define SLOT_SITE(n) {n, NULL, NULL, 0, 0}

static int site_resolve(slot_site *s, PyTypeObject *t) {
    if (s->name == NULL && (s->name = PyUnicode_InternFromString(s->cname)) == NULL) return -1;
    Py_ssize_t off = dvo_member_offset(t, s->name);
    if (off < 0) return -1;
    Py_INCREF(t);
    Py_XSETREF(s->type, t);
    s->tag = t->tp_version_tag;
    s->off = off;
    return 0;
}

static inline int site_ready(slot_site *s, PyObject *o) {
    PyTypeObject *t = Py_TYPE(o);
    if (t == s->type && t->tp_version_tag == s->tag && s->tag != 0) return 0;
    return site_resolve(s, t);
}

/* the cache-hit case inline (these run a dozen times per launch), the rest out of line */
static PyObject *sget_slow(slot_site *s, PyObject *o) {
    if (site_ready(s, o) < 0) return NULL;
    if (s->off > 0) {
        PyObject *v = *(PyObject **)((char *)o + s->off);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(o, s->name);
}

static int sset_slow(slot_site *s, PyObject *o, PyObject *v) {
    if (site_ready(s, o) < 0) return -1;
    if (s->off > 0) {
        PyObject **slot = (PyObject **)((char *)o + s->off);
        if (*slot != v) Py_XSETREF(*slot, Py_NewRef(v));
        return 0;
    }
    return PyObject_SetAttr(o, s->name, v);
}

#define SITE_HIT(s, o) (Py_TYPE(o) == (s)->type && (s)->off > 0 && Py_TYPE(o)->tp_version_tag == (s)->tag && (s)->tag != 0)

/* o.<name>: a new reference, or NULL with an error set */
static inline PyObject *sget(slot_site *s, PyObject *o) {
    if (SITE_HIT(s, o)) {
        PyObject *v = *(PyObject **)((char *)o + s->off);
        if (v != NULL) return Py_NewRef(v);
    }
    return sget_slow(s, o);
}

/* o.<name> = v; 0 or -1 with an error set */
static inline int sset(slot_site *s, PyObject *o, PyObject *v) {
    if (SITE_HIT(s, o)) {
        PyObject **slot = (PyObject **)((char *)o + s->off);
        if (*slot != v) Py_XSETREF(*slot, Py_NewRef(v));
        return 0;
    }
    return sset_slow(s, o, v);
}

/* A launch geometry packed once per plan (geometry(): fn, grid, block, shared memory). */
typedef struct {
    uint64_t fn;
    unsigned v[7];
} geom_t;

static int release_gil = 1;  /* set_gil_release(): for measuring what releasing costs */

/* geometry(fn, gx, gy, gz, bx, by, bz, shmem) -> bytes: what launch() takes as its first argument */
static PyObject *geometry(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "geometry(fn, gx, gy, gz, bx, by, bz, shmem) takes 8 ints");
        return NULL;
    }
    geom_t g;
    g.fn = (uint64_t)(uintptr_t)PyLong_AsVoidPtr(args[0]);
    for (int i = 0; i < 7; i++) g.v[i] = (unsigned)PyLong_AsUnsignedLong(args[1 + i]);
    if (PyErr_Occurred()) return NULL;
    return PyBytes_FromStringAndSize((const char *)&g, sizeof g);
}

/* launch(geometry, stream, params) -> CUresult
 * The geometry is built once per launch plan (geometry()); only the stream varies per call. */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_Check(args[0]) || PyBytes_GET_SIZE(args[0]) != (Py_ssize_t)sizeof(geom_t)) {
        PyErr_SetString(PyExc_TypeError, "launch(geometry(...), stream, params) takes 3 arguments");
        return NULL;
    }
    if (driver_missing(p_launch)) return NULL;
    geom_t g;
    memcpy(&g, PyBytes_AS_STRING(args[0]), sizeof g);
    void *stream = PyLong_AsVoidPtr(args[1]);
    void **params = (void **)PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) return NULL;
    int err;
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        err = p_launch((void *)(uintptr_t)g.fn, g.v[0], g.v[1], g.v[2], g.v[3], g.v[4], g.v[5], g.v[6], stream, params, NULL);
        Py_END_ALLOW_THREADS
    } else {
        err = p_launch((void *)(uintptr_t)g.fn, g.v[0], g.v[1], g.v[2], g.v[3], g.v[4], g.v[5], g.v[6], stream, params, NULL);
    }
    return PyLong_FromLong(err);
}

static PyObject *set_gil_release(PyObject *self, PyObject *flag) {
    int f = PyObject_IsTrue(flag);
    if (f < 0) return NULL;
    release_gil = f;
    Py_RETURN_NONE;
}

static slot_site T_BUFFER = SLOT_SITE("buffer"), T_SPAN = SLOT_SITE("_span"), B_ACCESSES = SLOT_SITE("accesses");

/* 1 if the execution ``cx`` already holds tensor ``t``'s byte span (with ``write`` if asked):
 * the last entry of its buffer's access list is cx's and covers the span. Mirrors the
 * Python fast check in kernels/_launch.py; anything else goes to the ledger's full path. */
static int held(PyObject *cx, PyObject *t, int write) {
    int ok = 0;
    PyObject *buf = sget(&T_BUFFER, t);
    if (buf == NULL) return -1;
    PyObject *acc = sget(&B_ACCESSES, buf);
    Py_DECREF(buf);
    if (acc == NULL) return -1;
    PyObject *span = sget(&T_SPAN, t);
    if (span == NULL) {
        Py_DECREF(acc);
        return -1;
    }
    if (PyList_Check(acc) && PyList_GET_SIZE(acc) > 0 && PyTuple_Check(span) && PyTuple_GET_SIZE(span) == 2) {
        PyObject *e = PyList_GET_ITEM(acc, PyList_GET_SIZE(acc) - 1);
        if (PyList_Check(e) && PyList_GET_SIZE(e) == 4 && PyList_GET_ITEM(e, 0) == cx) {
            long long elo = PyLong_AsLongLong(PyList_GET_ITEM(e, 1));
            long long ehi = PyLong_AsLongLong(PyList_GET_ITEM(e, 2));
            int ew = PyObject_IsTrue(PyList_GET_ITEM(e, 3));
            long long lo = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 0));
            long long hi = PyLong_AsLongLong(PyTuple_GET_ITEM(span, 1));
            if (PyErr_Occurred()) {
                ok = -1;
            } else {
                ok = elo <= lo && ehi >= hi && (ew || !write);
            }
        }
    }
    Py_DECREF(span);
    Py_DECREF(acc);
    return ok;
}

/* launch_held(cx, tensors, writes, geom, stream, params) -> CUresult, or -1 without launching
 * when some tensor is not already held by cx (the caller then registers through the ledger).
 * Call with the ledger lock held. */
static PyObject *launch_held(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2]) ||
        PyTuple_GET_SIZE(args[1]) > PyTuple_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, "launch_held(cx, tensors, writes, geom, stream, params): tensors and writes are tuples");
        return NULL;
    }
    PyObject *cx = args[0], *ts = args[1], *ws = args[2];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(ts); i++) {
        int h = held(cx, PyTuple_GET_ITEM(ts, i), PyTuple_GET_ITEM(ws, i) == Py_True);
        if (h < 0) return NULL;
        if (h == 0) return PyLong_FromLong(-1);
    }
    PyObject *rest[3] = {args[3], args[4], args[5]};
    return launch(self, rest, 3);
}


/* held_all(cx, tensors, writes) -> bool: cx already holds every tensor's span (see held()).
 * Call with the ledger lock held; False sends the caller through the ledger's full path. */
static PyObject *held_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2]) ||
        PyTuple_GET_SIZE(args[1]) > PyTuple_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError, "held_all(cx, tensors, writes): tensors and writes are tuples");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); i++) {
        int h = held(args[0], PyTuple_GET_ITEM(args[1], i), PyTuple_GET_ITEM(args[2], i) == Py_True);
        if (h < 0) return NULL;
        if (h == 0) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

static PyObject *s_acquire, *s_release;
static slot_site P_TENSOR = SLOT_SITE("tensor"), CX_SH = SLOT_SITE("sh"), PK_LAST_PTRS = SLOT_SITE("last_ptrs"),
                 PK_LAST_SCALARS = SLOT_SITE("last_scalars");

static PyObject *lock_acquire, *lock_release;  /* the ledger lock's bound methods (set_lock) */
static LockObject *native_lock;                  /* or the lock itself, if it is a native Lock */

/* set_lock(lock): the ledger lock run_planned takes (a native Lock, or any lock's acquire/release) */
static PyObject *set_lock(PyObject *self, PyObject *lock) {
    if (Py_IS_TYPE(lock, &LockType)) {
        Py_INCREF(lock);
        Py_XSETREF(native_lock, (LockObject *)lock);
    } else {
        Py_CLEAR(native_lock);
    }
    PyObject *a = PyObject_GetAttr(lock, s_acquire), *r = PyObject_GetAttr(lock, s_release);
    if (a == NULL || r == NULL) {
        Py_XDECREF(a);
        Py_XDECREF(r);
        return NULL;
    }
    Py_XSETREF(lock_acquire, a);
    Py_XSETREF(lock_release, r);
    Py_RETURN_NONE;
}

/* The rest of run_planned once the lock is held: -1 if some tensor is not held yet. */
static PyObject *run_planned_locked(PyObject *cx, PyObject *a, Py_ssize_t nt, PyObject *writes, PyObject *geom,
                                    PyObject *addr) {
    if (!PyTuple_Check(writes) || PyTuple_GET_SIZE(writes) < nt) {
        PyErr_SetString(PyExc_TypeError, "run_planned: plan writes must be a tuple covering the tensors");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < nt; i++) {
        PyObject *t = i == 0 ? sget(&P_TENSOR, PyTuple_GET_ITEM(a, 0)) : PyTuple_GET_ITEM(a, i);
        if (t == NULL) return NULL;
        int h = held(cx, t, PyTuple_GET_ITEM(writes, i) == Py_True);
        if (i == 0) Py_DECREF(t);
        if (h <= 0) return h < 0 ? NULL : PyLong_FromLong(-1);
    }
    PyObject *rest[3] = {geom, sget(&CX_SH, cx), addr};
    if (rest[1] == NULL) return NULL;
    PyObject *r = launch(NULL, rest, 3);
    Py_DECREF(rest[1]);
    return r;
}

/* run_planned(cx, fast, args) -> CUresult, or -1 (nothing launched).
 * The chained launch of a planned elementwise call in one C call: args[0] is the output
 * Partition, args[1:nt] the input tensors, args[nt:] the scalars; fast = (nt, packer, writes,
 * geometry, params address, pointers[, backend]) from the plan. Launches only if the parameter
 * block already holds these pointers and scalars and cx already holds every tensor (checked
 * and launched under the ledger lock, see set_lock); otherwise the caller takes the full path
 * (repack, ledger registration). */
static PyObject *run_planned(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) < 6 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "run_planned(cx, fast, args): fast is (nt, packer, writes, geom, addr, ptrs, ...)");
        return NULL;
    }
    if (p_launch == NULL || lock_acquire == NULL) return PyLong_FromLong(-1);
    PyObject *cx = args[0], *fast = args[1], *a = args[2];
    Py_ssize_t nt = PyLong_AsSsize_t(PyTuple_GET_ITEM(fast, 0));
    PyObject *packer = PyTuple_GET_ITEM(fast, 1);
    Py_ssize_t n = PyTuple_GET_SIZE(a);
    PyObject *result = NULL;
    PyObject *lp = NULL, *ls = NULL;
    if (nt < 0 && PyErr_Occurred()) goto done;
    if (nt < 1 || nt > n) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    lp = sget(&PK_LAST_PTRS, packer);
    ls = sget(&PK_LAST_SCALARS, packer);
    if (lp == NULL || ls == NULL) goto done;
    int same = lp == PyTuple_GET_ITEM(fast, 5) && PyTuple_Check(ls) && PyTuple_GET_SIZE(ls) == n - nt;
    for (Py_ssize_t i = 0; same && i < n - nt; i++) {
        int eq = PyObject_RichCompareBool(PyTuple_GET_ITEM(ls, i), PyTuple_GET_ITEM(a, nt + i), Py_EQ);
        if (eq < 0) goto done;
        same = eq;
    }
    if (!same) {
        result = PyLong_FromLong(-1);
        goto done;
    }
    if (native_lock != NULL) {
        if (lock_take(native_lock) < 0) goto done;
        result = run_planned_locked(cx, a, nt, PyTuple_GET_ITEM(fast, 2), PyTuple_GET_ITEM(fast, 3), PyTuple_GET_ITEM(fast, 4));
        lock_drop(native_lock);
        goto done;
    }
    PyObject *r = PyObject_CallNoArgs(lock_acquire);
    if (r == NULL) goto done;
    Py_DECREF(r);
    result = run_planned_locked(cx, a, nt, PyTuple_GET_ITEM(fast, 2), PyTuple_GET_ITEM(fast, 3), PyTuple_GET_ITEM(fast, 4));
    PyObject *et, *ev, *etb;  /* keep an error from the launch path across release() */
    PyErr_Fetch(&et, &ev, &etb);
    r = PyObject_CallNoArgs(lock_release);
    if (r == NULL) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(etb);
        Py_CLEAR(result);
    } else {
        Py_DECREF(r);
        PyErr_Restore(et, ev, etb);
    }
done:
    Py_XDECREF(lp);
    Py_XDECREF(ls);
    return result;
}

static PyObject *s_used, *s_run, *s_take, *s_then, *s_map, *s_backend, *s_then_by;
static slot_site OP_PLAN = SLOT_SITE("_plan"), PLAN_FAST = SLOT_SITE("fast"), CX_BACKEND = SLOT_SITE("backend"),
                 OP_ARGS = SLOT_SITE("_args"), OP_USED = SLOT_SITE("_used");

/* The planned fast path of one op inside run_steps: the op's output (its args), or NULL with
 * no error set when the generic path must run it. */
static PyObject *try_planned(PyObject *cx, PyObject *op) {
    PyObject *p = sget(&OP_PLAN, op);
    if (p == NULL) return NULL;
    PyObject *fast = sget(&PLAN_FAST, p);
    Py_DECREF(p);
    if (fast == NULL) return NULL;
    PyObject *out = NULL, *cbe = NULL, *a = NULL;
    if (!PyTuple_Check(fast) || PyTuple_GET_SIZE(fast) != 7) goto done;  /* None: not a cuda plan */
    cbe = sget(&CX_BACKEND, cx);
    if (cbe == NULL || cbe != PyTuple_GET_ITEM(fast, 6)) goto done;
    a = sget(&OP_ARGS, op);
    if (a == NULL || !PyTuple_Check(a)) goto done;
    PyObject *argv[3] = {cx, fast, a};
    PyObject *r = run_planned(NULL, argv, 3);
    if (r == NULL) goto done;
    long err = PyLong_AsLong(r);
    Py_DECREF(r);
    if (err == 0) {
        Py_INCREF(a);
        out = a;
    }
    /* err != 0: the generic _run repeats the checks and raises a launch error properly */
done:
    Py_DECREF(fast);
    Py_XDECREF(cbe);
    Py_XDECREF(a);
    return out;
}

/* run_steps(cx, out, steps, op_type, planned_type, fast) -> (i, value)
 * The step loop of a then/map/inspect chain. Returns (len(steps), output) when done, or
 * (i, returned) when step i's function returned something that is not an op (the caller
 * raises the usage error). ``fast``: the planned launch may be tried (native driver bound and
 * the ledger on). Exceptions from the steps propagate. */
static PyObject *run_steps(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "run_steps(cx, out, steps, op_type, planned_type, fast)");
        return NULL;
    }
    PyObject *cx = args[0], *steps = args[2], *op_type = args[3], *planned = args[4];
    int fast = PyObject_IsTrue(args[5]) && p_launch != NULL;
    PyObject *out = args[1];
    Py_INCREF(out);
    Py_ssize_t i;
    for (i = 0; i < PyList_GET_SIZE(steps); i++) {
        PyObject *st = PyList_GET_ITEM(steps, i);
        if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != 2) {
            PyErr_SetString(PyExc_TypeError, "run_steps: a step is a (kind, function) tuple");
            goto fail;
        }
        PyObject *kind = PyTuple_GET_ITEM(st, 0), *f = PyTuple_GET_ITEM(st, 1);
        PyObject *v = PyObject_CallOneArg(f, out);
        if (v == NULL) goto fail;
        if (kind == s_then || PyUnicode_Compare(kind, s_then) == 0) {
            int isop = Py_IS_TYPE(v, (PyTypeObject *)planned) || PyObject_IsInstance(v, op_type);
            if (isop < 0) {
                Py_DECREF(v);
                goto fail;
            }
            if (!isop) {
                Py_DECREF(out);
                PyObject *r = Py_BuildValue("(nN)", i, v);
                return r;
            }
            int pl = Py_IS_TYPE(v, (PyTypeObject *)planned);  /* the common type gets the cached slot */
            PyObject *used = pl ? sget(&OP_USED, v) : PyObject_GetAttr(v, s_used);
            if (used == NULL) {
                Py_DECREF(v);
                goto fail;
            }
            int ok;
            if (used == Py_None) {
                ok = (pl ? sset(&OP_USED, v, s_then_by) : PyObject_SetAttr(v, s_used, s_then_by)) == 0;
            } else {  /* already consumed: _take raises the usage error */
                PyObject *r = PyObject_CallMethodOneArg(v, s_take, s_then_by);
                ok = r != NULL;
                Py_XDECREF(r);
            }
            Py_DECREF(used);
            if (!ok) {
                Py_DECREF(v);
                goto fail;
            }
            PyObject *nout = NULL;
            if (fast && Py_IS_TYPE(v, (PyTypeObject *)planned)) {
                nout = try_planned(cx, v);
                if (nout == NULL && PyErr_Occurred()) {
                    Py_DECREF(v);
                    goto fail;
                }
            }
            if (nout == NULL) nout = PyObject_CallMethodOneArg(v, s_run, cx);
            Py_DECREF(v);
            if (nout == NULL) goto fail;
            Py_DECREF(out);
            out = nout;
        } else if (kind == s_map || PyUnicode_Compare(kind, s_map) == 0) {
            Py_DECREF(out);
            out = v;
        } else {  /* inspect: the output passes on */
            Py_DECREF(v);
        }
    }
    return Py_BuildValue("(nN)", i, out);
fail:
    Py_DECREF(out);
    return NULL;
}

/* lt_matmul((fn, handle, desc, A, Adesc, B, Bdesc, C, Cdesc, algo), alpha, beta, workspace,
 * workspace_bytes, stream) -> cublasStatus_t. D = C (in place). fn is cublasLtMatmul's address,
 * the rest are handles and device pointers as ints, alpha/beta host floats. */
static PyObject *lt_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 10) {
        PyErr_SetString(PyExc_TypeError, "lt_matmul(static 10-tuple, alpha, beta, workspace, workspace_bytes, stream)");
        return NULL;
    }
    void *v[10];
    for (int i = 0; i < 10; i++) v[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[0], i));
    float alpha = (float)PyFloat_AsDouble(args[1]), beta = (float)PyFloat_AsDouble(args[2]);
    void *ws = PyLong_AsVoidPtr(args[3]);
    size_t wsz = PyLong_AsSize_t(args[4]);
    void *stream = PyLong_AsVoidPtr(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (v[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "lt_matmul: no cublasLtMatmul address");
        return NULL;
    }
    int st;
    Py_BEGIN_ALLOW_THREADS
    st = ((ltmatmul_fn)v[0])(v[1], v[2], &alpha, v[3], v[4], v[5], v[6], &beta, v[7], v[8], v[7], v[8], v[9], ws, wsz, stream);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(st);
}

/* graph_launch(exec, stream) -> CUresult */
static PyObject *graph_launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "graph_launch(exec, stream) takes 2 ints");
        return NULL;
    }
    void *g = PyLong_AsVoidPtr(args[0]), *s = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (driver_missing(p_graph_launch)) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = p_graph_launch(g, s);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* stream_sync(stream) -> CUresult (the GIL is released while it waits) */
static PyObject *stream_sync(PyObject *self, PyObject *sobj) {
    void *h = PyLong_AsVoidPtr(sobj);
    if (PyErr_Occurred()) return NULL;
    if (driver_missing(p_stream_sync)) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = p_stream_sync(h);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* event_record(event, stream) -> CUresult;  event_query(event) -> CUresult (0: complete) */
static PyObject *event_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "event_record(event, stream) takes 2 ints");
        return NULL;
    }
    void *e = PyLong_AsVoidPtr(args[0]), *s = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (driver_missing(p_ev_record)) return NULL;
    return PyLong_FromLong(p_ev_record(e, s));
}

static PyObject *event_query(PyObject *self, PyObject *e) {
    void *h = PyLong_AsVoidPtr(e);
    if (PyErr_Occurred()) return NULL;
    if (driver_missing(p_ev_query)) return NULL;
    return PyLong_FromLong(p_ev_query(h));
}

/* ---- the ledger's release, and the lean replay of a graph ------------------------------- */

static slot_site CX_BUFFERS = SLOT_SITE("buffers"), CX_CHILDREN = SLOT_SITE("children"), CX_DONE_CBS = SLOT_SITE("_done_cbs"),
                 CX_DONE = SLOT_SITE("done"), CX_WAITED = SLOT_SITE("_waited"), CX_OP = SLOT_SITE("op"),
                 GL_USED = SLOT_SITE("_used"), GL_G = SLOT_SITE("_g");
static PyObject *s_finish, *s_scope;

/* Remove item i of list l keeping its storage: PyList_SetSlice frees the storage of a list that
 * empties, and the ledger's lists empty and refill on every replay. The list is consistent
 * before the removed item is released. */
static void list_del_keep(PyObject *l, Py_ssize_t i) {
    PyObject **items = ((PyListObject *)l)->ob_item, *v = items[i];
    Py_ssize_t n = PyList_GET_SIZE(l);
    memmove(&items[i], &items[i + 1], (size_t)(n - i - 1) * sizeof(PyObject *));
    Py_SET_SIZE(l, n - 1);
    Py_DECREF(v);
}

static void list_clear_keep(PyObject *l) {
    while (PyList_GET_SIZE(l) > 0) list_del_keep(l, PyList_GET_SIZE(l) - 1);
}

/* Drop every access entry of ``cx`` from the buffers it touched; call with the ledger lock held.
 * The twin of the Python loop in device/_ledger.py (release). */
static int release_entries(PyObject *cx) {
    PyObject *bufs = sget(&CX_BUFFERS, cx);
    if (bufs == NULL) return -1;
    if (!PyList_Check(bufs)) {
        Py_DECREF(bufs);
        PyErr_SetString(PyExc_TypeError, "release: an execution's buffers are a list");
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyList_GET_SIZE(bufs); i++) {
        PyObject *buf = PyList_GET_ITEM(bufs, i);
        Py_INCREF(buf);
        PyObject *acc = sget(&B_ACCESSES, buf);
        if (acc == NULL) {
            rc = -1;
        } else if (PyList_Check(acc) && PyList_GET_SIZE(acc) > 0) {
            Py_ssize_t n = PyList_GET_SIZE(acc), mine = 0;
            for (Py_ssize_t j = 0; j < n; j++) {
                PyObject *e = PyList_GET_ITEM(acc, j);
                mine += PyList_Check(e) && PyList_GET_SIZE(e) > 0 && PyList_GET_ITEM(e, 0) == cx;
            }
            /* in place (the lock is held; readers copy the list under the GIL) */
            for (Py_ssize_t j = n - 1; mine && rc == 0 && j >= 0; j--) {
                PyObject *e = PyList_GET_ITEM(acc, j);
                if (PyList_Check(e) && PyList_GET_SIZE(e) > 0 && PyList_GET_ITEM(e, 0) == cx) {
                    if (PyList_CheckExact(acc)) list_del_keep(acc, j);
                    else rc = PyList_SetSlice(acc, j, j + 1, NULL);
                    mine--;
                }
            }
        }
        Py_XDECREF(acc);
        Py_DECREF(buf);
    }
    Py_DECREF(bufs);
    return rc;
}

/* ledger_release(cx): forget every access of a finished execution (takes the ledger lock) */
static PyObject *ledger_release(PyObject *self, PyObject *cx) {
    if (native_lock == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "ledger_release: no native ledger lock (set_lock first)");
        return NULL;
    }
    if (lock_take(native_lock) < 0) return NULL;
    int rc = release_entries(cx);
    lock_drop(native_lock);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

/* set_replay(...): what the lean replay needs, set once the driver is bound (device/_fast.py) */
static PyObject *rp_maker, *rp_capture, *rp_recording, *rp_stream_type, *rp_touch, *rp_enabled, *rp_error, *rp_next_stream,
    *rp_switch, *empty_tuple;

static PyObject *set_replay(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9 || !PyList_Check(args[2]) || !PyType_Check(args[3]) || !PyList_Check(args[5]) || !PyList_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "set_replay(context_maker, capture_state, recording, stream_type, touch, enabled, "
                                         "cuda_error, next_stream, switch)");
        return NULL;
    }
    PyObject **dst[9] = {&rp_maker, &rp_capture, &rp_recording, &rp_stream_type, &rp_touch, &rp_enabled, &rp_error,
                         &rp_next_stream, &rp_switch};
    for (int i = 0; i < 9; i++) Py_XSETREF(*dst[i], Py_NewRef(args[i]));
    Py_RETURN_NONE;
}

static void set_cuda_error(int err, const char *what) {
    PyObject *e = PyObject_CallFunction(rp_error, "is", err, what);
    if (e != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(e), e);
        Py_DECREF(e);
    }
}

/* Register cx's access to one recorded region: inline when nobody else has the buffer in flight
 * (the common case; ``entry`` is cx's entry for it, [cx, lo, hi, write]), else through the
 * ledger's Python touch (ordering, strict mode). */
static int touch_region(PyObject *cx, PyObject *bufs, PyObject *reg, PyObject *entry, PyObject *op) {
    PyObject *buf = PyTuple_GET_ITEM(reg, 0);
    PyObject *acc = sget(&B_ACCESSES, buf);
    if (acc == NULL) return -1;
    int rc;
    if (PyList_CheckExact(acc) && PyList_GET_SIZE(acc) == 0) {
        rc = PyList_Append(acc, entry) < 0 || PyList_Append(bufs, buf) < 0 ? -1 : 0;
    } else {
        PyObject *r = PyObject_CallFunctionObjArgs(rp_touch, cx, buf, PyTuple_GET_ITEM(reg, 1), PyTuple_GET_ITEM(reg, 2),
                                                   PyTuple_GET_ITEM(reg, 3), op, NULL);
        rc = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    Py_DECREF(acc);
    return rc;
}

/* cx's ledger entries for ``regions``: a tuple of [cx, lo, hi, write] lists */
static PyObject *make_entries(PyObject *cx, PyObject *regions) {
    Py_ssize_t n = PyTuple_GET_SIZE(regions);
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; t != NULL && i < n; i++) {
        PyObject *reg = PyTuple_GET_ITEM(regions, i);
        PyObject *e = NULL;
        if (!PyTuple_Check(reg) || PyTuple_GET_SIZE(reg) != 4) {
            PyErr_SetString(PyExc_TypeError, "replay: a region is (buffer, lo, hi, write)");
        } else if ((e = PyList_New(4)) != NULL) {
            PyList_SET_ITEM(e, 0, Py_NewRef(cx));
            for (int k = 1; k < 4; k++) PyList_SET_ITEM(e, k, Py_NewRef(PyTuple_GET_ITEM(reg, k)));
        }
        if (e == NULL) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, e);
    }
    return t;
}

/* After a failure with work possibly enqueued: wait for the stream, finish cx as failed, keep
 * the original error (as executors/_terminals.py does). */
static PyObject *replay_failed(PyObject *cx, void *sh) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    Py_BEGIN_ALLOW_THREADS
    p_stream_sync(sh);
    Py_END_ALLOW_THREADS
    PyObject *r = PyObject_CallMethod(cx, "finish", "O", Py_False);
    if (r == NULL) PyErr_Clear();
    Py_XDECREF(r);
    PyErr_Restore(et, ev, etb);
    return NULL;
}

/* The end of a replay whose work is complete: what ExecutionContext.finish does for an execution
 * without children or completion callbacks (others go through finish itself). */
static int replay_finish(PyObject *cx, PyObject *bufs) {
    PyObject *ch = sget(&CX_CHILDREN, cx);
    if (ch == NULL) return -1;
    PyObject *cbs = sget(&CX_DONE_CBS, cx);
    if (cbs == NULL) {
        Py_DECREF(ch);
        return -1;
    }
    int plain = PyObject_Length(ch) == 0 && cbs == Py_None;
    Py_DECREF(ch);
    Py_DECREF(cbs);
    if (PyErr_Occurred()) return -1;
    if (!plain) {
        PyObject *r = PyObject_CallMethodNoArgs(cx, s_finish);
        Py_XDECREF(r);
        return r == NULL ? -1 : 0;
    }
    if (sset(&CX_DONE, cx, Py_True) < 0) return -1;
    if (lock_take(native_lock) < 0) return -1;
    int rc = release_entries(cx);
    lock_drop(native_lock);
    if (rc < 0) return -1;
    if (PyList_CheckExact(bufs)) list_clear_keep(bufs);
    else if (PyList_SetSlice(bufs, 0, PyList_GET_SIZE(bufs), NULL) < 0) return -1;
    return sset(&CX_WAITED, cx, empty_tuple) < 0 || sset(&CX_OP, cx, Py_None) < 0 ? -1 : 0;
}

/* GraphBase: the base of CudaGraph. Its replay view (``_fast``) and launch count are C fields,
 * so a replay reads them without attribute lookups and counts without allocating an int. */
typedef struct {
    PyObject_HEAD
    PyObject *fast;   /* checked when set (GB_set_fast): (backend, context, exec, exec handle, regions, output, park) */
    void *ctx, *exh;  /* its context and exec handle as pointers */
    Py_ssize_t launches;
} GraphBaseObject;

static PyTypeObject GraphBaseType;

/* the one CudaGraph class a process replays, remembered once seen to derive from GraphBase */
static PyTypeObject *graph_type_seen;

static inline int graph_type_ok(PyTypeObject *t) {
    if (t == graph_type_seen) return 1;
    if (!PyType_IsSubtype(t, &GraphBaseType)) return 0;
    Py_INCREF(t);
    Py_XSETREF(graph_type_seen, t);
    return 1;
}

static slot_site CX_STREAM = SLOT_SITE("stream"), CX_LABEL = SLOT_SITE("label"), CX_EVENT = SLOT_SITE("_event"),
                 CX_SEALED = SLOT_SITE("_sealed"), CX_WAITED_ON = SLOT_SITE("_waited_on"), ST_BACKEND = SLOT_SITE("backend"),
                 ST_HANDLE = SLOT_SITE("handle_int");

/* A free list of one launch op: a loop of ``g.launch().sync_on(s)`` makes and drops one op per
 * replay, and allocating and freeing it is a measurable share of a small graph's replay. A
 * replay that finished parks its op here with its graph reference cleared (so it holds nothing
 * alive); GraphBase.launch() reuses it when nothing else references it (refcount 1: no name,
 * no execution context; launch ops take no weak references), else makes a new one. */
static PyObject *spare_launch;
static PyTypeObject *launch_type;  /* what the launch maker makes: only those are parked */

/* One replay of a CudaGraph and the wait for it, as the generic path does it (graph/_graph.py
 * GraphLaunch._run under executors/_terminals.py run_sync) without its Python frames: consume the
 * op, make the device's context current, build the execution context, register the graph's
 * regions and launch under the ledger lock, wait for the stream (GIL released), release.
 * Returns 1 when done (*out: the graph's output, or NULL with an error set) and 0 when it does
 * not apply, having done nothing: another stream type or backend, a recording open on this
 * thread, the ledger off, an op already consumed (the generic terminal then runs, and raises
 * the usage errors). */
static int replay_core(PyObject *op, PyObject *stream, PyObject *label, PyObject **out) {
    *out = NULL;
    if (rp_maker == NULL || p_graph_launch == NULL || native_lock == NULL) return 0;
    if (!Py_IS_TYPE(stream, (PyTypeObject *)rp_stream_type) || PyList_GET_SIZE(rp_enabled) < 1 ||
        PyList_GET_ITEM(rp_enabled, 0) != Py_True)
        return 0;
    PyObject *used = sget(&GL_USED, op);
    if (used == NULL) return 1;
    Py_DECREF(used);
    if (used != Py_None) return 0;
    /* a recording on this thread refuses the replay (generic path); skip the thread-local
     * lookup while no recording is open anywhere */
    if (PyList_GET_SIZE(rp_recording) < 1 || PyLong_AsLong(PyList_GET_ITEM(rp_recording, 0)) != 0) {
        if (PyErr_Occurred()) return 1;
        PyObject *scope = PyObject_GetAttr(rp_capture, s_scope);
        if (scope == NULL) return 1;
        Py_DECREF(scope);
        if (scope != Py_None) return 0;
    }

    int applies = 0;
    PyObject *g = NULL, *fast = NULL, *be = NULL, *sho = NULL, *cx = NULL, *bufs = NULL, *entries = NULL;
    g = sget(&GL_G, op);
    if (g == NULL || !graph_type_ok(Py_TYPE(g))) goto done;
    GraphBaseObject *gb = (GraphBaseObject *)g;
    if (gb->fast == NULL) goto done;
    /* fast: (backend, context, exec object, exec handle or 0, regions, output, park), checked
     * when set; park is [execution context, its ledger entries] kept between replays, or
     * [None, None] */
    fast = Py_NewRef(gb->fast);
    void *ctx = gb->ctx, *ex = gb->exh;
    be = sget(&ST_BACKEND, stream);
    if (be == NULL || PyTuple_GET_ITEM(fast, 0) != be) goto done;
    sho = sget(&ST_HANDLE, stream);
    if (sho == NULL) goto done;
    void *sh = PyLong_AsVoidPtr(sho);
    if (PyErr_Occurred()) goto done;
    PyObject *regions = PyTuple_GET_ITEM(fast, 4), *park = PyTuple_GET_ITEM(fast, 6);
    if (PyList_GET_SIZE(park) != 2) goto done;  /* (a list: someone may have resized it) */

    applies = 1;  /* from here on the op is consumed, as by the generic terminal */
    if (sset(&GL_USED, op, label) < 0) goto done;
    void *cur = NULL;
    int err = p_ctx_get(&cur);
    if (!err && cur != ctx) err = p_ctx_set(ctx);
    if (err) {
        set_cuda_error(err, "cuCtxSetCurrent");
        goto done;
    }
    /* The execution context: the one the last replay of this graph parked (with its ledger
     * entries), else a new one. A context another execution waited on is never parked (that
     * execution remembers having waited for it), so a parked one is referenced by nothing
     * else; concurrent replays of one graph find the park empty and make their own. */
    if (PyList_GET_ITEM(park, 0) != Py_None) {
        cx = Py_NewRef(PyList_GET_ITEM(park, 0));
        entries = Py_NewRef(PyList_GET_ITEM(park, 1));
        if (PyList_SetItem(park, 0, Py_NewRef(Py_None)) < 0 || PyList_SetItem(park, 1, Py_NewRef(Py_None)) < 0) goto done;
        if (sset(&CX_STREAM, cx, stream) < 0 || sset(&CX_SH, cx, sho) < 0 || sset(&CX_BACKEND, cx, be) < 0 ||
            sset(&CX_OP, cx, op) < 0 || sset(&CX_LABEL, cx, label) < 0 || sset(&CX_DONE, cx, Py_False) < 0 ||
            sset(&CX_EVENT, cx, Py_None) < 0 || sset(&CX_SEALED, cx, Py_False) < 0)
            goto done;
    } else {
        PyObject *mv[5] = {stream, sho, be, op, label};
        cx = dvo_make(rp_maker, mv, 5);
        if (cx == NULL || (entries = make_entries(cx, regions)) == NULL) goto done;
    }
    bufs = sget(&CX_BUFFERS, cx);
    if (bufs == NULL || !PyList_Check(bufs) || !PyTuple_Check(entries) || PyTuple_GET_SIZE(entries) != PyTuple_GET_SIZE(regions)) {
        if (bufs != NULL) PyErr_SetString(PyExc_TypeError, "replay: bad execution context or entries");
        goto done;
    }

    if (lock_take(native_lock) < 0) goto done;
    int rc = 0;
    for (Py_ssize_t i = 0; rc == 0 && i < PyTuple_GET_SIZE(regions); i++)
        rc = touch_region(cx, bufs, PyTuple_GET_ITEM(regions, i), PyTuple_GET_ITEM(entries, i), op);
    if (rc == 0) ((GraphBaseObject *)g)->launches++;
    if (rc < 0) {
        lock_drop(native_lock);
        replay_failed(cx, sh);
        goto done;
    }
    /* launch, give the lock back and wait, in one stretch without the GIL (the lock needs none) */
    int serr = 0;
    Py_BEGIN_ALLOW_THREADS
    if (ex != NULL) err = p_graph_launch(ex, sh);
    lock_drop(native_lock);
    if (!err) serr = p_stream_sync(sh);
    Py_END_ALLOW_THREADS
    if (err || serr) {
        if (err && lock_take(native_lock) == 0) {  /* it did not run: uncount it */
            ((GraphBaseObject *)g)->launches--;
            lock_drop(native_lock);
        }
        set_cuda_error(err ? err : serr, err ? "cuGraphLaunch" : "cuStreamSynchronize");
        replay_failed(cx, sh);
        goto done;
    }
    if (replay_finish(cx, bufs) < 0) goto done;
    PyObject *pinned = sget(&CX_WAITED_ON, cx);
    if (pinned == NULL) goto done;
    Py_DECREF(pinned);
    if (pinned == Py_False && PyList_GET_ITEM(park, 0) == Py_None) {
        if (PyList_SetItem(park, 0, Py_NewRef(cx)) < 0 || PyList_SetItem(park, 1, Py_NewRef(entries)) < 0) goto done;
    }
    *out = Py_NewRef(PyTuple_GET_ITEM(fast, 5));
    if (Py_TYPE(op) == launch_type) {
        if (sset(&GL_G, op, Py_None) < 0) Py_CLEAR(*out);
        else Py_XSETREF(spare_launch, Py_NewRef(op));
    }
done:
    if (!applies && PyErr_Occurred()) applies = 1;  /* an error before the op was taken: report it */
    Py_XDECREF(g);
    Py_XDECREF(fast);
    Py_XDECREF(be);
    Py_XDECREF(sho);
    Py_XDECREF(cx);
    Py_XDECREF(bufs);
    Py_XDECREF(entries);
    return applies;
}

/* ---- ReplayBase: the sync terminals of a graph launch ---------------------------------- */

static PyObject *s_lbl_sync_on, *s_lbl_sync, *s_generic_sync_on, *s_generic_sync;

static int replay_on(void) {
    return rp_maker != NULL && PyList_GET_SIZE(rp_switch) > 0 && PyList_GET_ITEM(rp_switch, 0) != Py_None;
}

static PyObject *RB_sync_on(PyObject *self, PyObject *stream) {
    PyObject *out;
    if (replay_on() && replay_core(self, stream, s_lbl_sync_on, &out)) return out;
    return PyObject_CallMethodOneArg(self, s_generic_sync_on, stream);
}

static PyObject *RB_sync(PyObject *self, PyObject *unused) {
    if (!replay_on()) return PyObject_CallMethodOneArg(self, s_generic_sync, Py_None);
    PyObject *s = PyObject_CallNoArgs(rp_next_stream), *out;
    if (s == NULL) return NULL;
    if (!replay_core(self, s, s_lbl_sync, &out)) out = PyObject_CallMethodOneArg(self, s_generic_sync, s);
    Py_DECREF(s);
    return out;
}

static PyMethodDef RB_methods[] = {
    {"sync_on", (PyCFunction)RB_sync_on, METH_O,
     "Run on ``stream``, wait for completion, return the output (one native call for a graph replay)."},
    {"sync", (PyCFunction)RB_sync, METH_NOARGS,
     "Run on the next pool stream, wait for completion, return the output (one native call for a graph replay)."},
    {NULL, NULL, 0, NULL},
};

/* GraphBase: the base of CudaGraph whose launch() builds the launch op natively */
static PyObject *launch_maker, *s_generic_launch;

static PyObject *set_launch_maker(PyObject *self, PyObject *maker) {
    Py_XSETREF(launch_maker, Py_NewRef(maker));
    Py_CLEAR(spare_launch);  /* the free list holds ops of the old maker's type */
    Py_CLEAR(launch_type);
    Py_RETURN_NONE;
}

static PyObject *GB_launch(PyObject *self, PyObject *unused) {
    if (launch_maker == NULL) return PyObject_CallMethodNoArgs(self, s_generic_launch);
    PyObject *op = spare_launch;
    if (op != NULL && Py_REFCNT(op) == 1) {  /* referenced by nothing else: reuse it */
        spare_launch = NULL;
        if (sset(&GL_USED, op, Py_None) < 0 || sset(&GL_G, op, self) < 0) Py_CLEAR(op);
        return op;
    }
    PyObject *v[2] = {Py_None, self};
    op = dvo_make(launch_maker, v, 2);
    if (op != NULL && launch_type == NULL) launch_type = (PyTypeObject *)Py_NewRef(Py_TYPE(op));
    return op;
}

static PyMethodDef GB_methods[] = {
    {"launch", (PyCFunction)GB_launch, METH_NOARGS,
     "An op that replays the graph once, on the stream of the terminal that drives it."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef GB_members[] = {
    {"launches", T_PYSSIZET, offsetof(GraphBaseObject, launches), 0, "Replays enqueued so far."},
    {NULL, 0, 0, 0, NULL},
};

static PyObject *GB_get_fast(GraphBaseObject *self, void *closure) {
    return Py_NewRef(self->fast != NULL ? self->fast : Py_None);
}

/* _fast = (backend, context, exec, exec handle, regions, output, park) or None; checked here so
 * the replay only reads it */
static int GB_set_fast(GraphBaseObject *self, PyObject *v, void *closure) {
    void *ctx = NULL, *exh = NULL;
    if (v != NULL && v != Py_None) {
        PyObject *park = PyTuple_Check(v) && PyTuple_GET_SIZE(v) == 7 ? PyTuple_GET_ITEM(v, 6) : NULL;
        int ok = park != NULL && PyList_CheckExact(park) && PyList_GET_SIZE(park) == 2 &&
                 PyTuple_Check(PyTuple_GET_ITEM(v, 4)) && PyLong_Check(PyTuple_GET_ITEM(v, 1)) &&
                 PyLong_Check(PyTuple_GET_ITEM(v, 3));
        for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(PyTuple_GET_ITEM(v, 4)); i++) {
            PyObject *reg = PyTuple_GET_ITEM(PyTuple_GET_ITEM(v, 4), i);
            ok = PyTuple_Check(reg) && PyTuple_GET_SIZE(reg) == 4;
        }
        if (!ok) {
            PyErr_SetString(PyExc_TypeError, "_fast is (backend, context: int, exec, exec handle: int, "
                                             "regions: tuple of (buffer, lo, hi, write), output, [None, None]) or None");
            return -1;
        }
        ctx = PyLong_AsVoidPtr(PyTuple_GET_ITEM(v, 1));
        exh = PyLong_AsVoidPtr(PyTuple_GET_ITEM(v, 3));
        if (PyErr_Occurred()) return -1;
    }
    Py_XSETREF(self->fast, v != NULL && v != Py_None ? Py_NewRef(v) : NULL);
    self->ctx = ctx;
    self->exh = exh;
    return 0;
}

static PyGetSetDef GB_getset[] = {
    {"_fast", (getter)GB_get_fast, (setter)GB_set_fast,
     "The native replay's view: (backend, context, exec, exec handle, regions, output, park), or None.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static int GB_traverse(GraphBaseObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->fast);
    return 0;
}

static int GB_clear(GraphBaseObject *self) {
    Py_CLEAR(self->fast);
    return 0;
}

static void GB_dealloc(GraphBaseObject *self) {
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->fast);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject GraphBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "deviceop._native.GraphBase",
    .tp_basicsize = sizeof(GraphBaseObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of CudaGraph: launch() builds the launch op natively (set_launch_maker), else self._generic_launch(); "
              "_fast and launches are C fields.",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)GB_dealloc,
    .tp_traverse = (traverseproc)GB_traverse,
    .tp_clear = (inquiry)GB_clear,
    .tp_methods = GB_methods,
    .tp_members = GB_members,
    .tp_getset = GB_getset,
};

static PyTypeObject ReplayBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "deviceop._native.ReplayBase",
    .tp_basicsize = sizeof(PyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Base of graph launch ops: sync terminals that replay in one native call (falling back to "
              "self._generic_sync_on(stream) / self._generic_sync(stream or None)).",
    .tp_new = PyType_GenericNew,
    .tp_methods = RB_methods,
};

static PyMethodDef module_methods[] = {
    {"load_driver", load_driver, METH_NOARGS, "Find cuLaunchKernel / cuLaunchHostFunc in the loaded libcuda; True on success."},
    {"geometry", (PyCFunction)(void (*)(void))geometry, METH_FASTCALL,
     "geometry(fn, gx, gy, gz, bx, by, bz, shmem) -> bytes: a launch geometry for launch()."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch(geometry, stream, params) -> CUresult (stream: an int; params: a void** address)."},
    {"set_gil_release", (PyCFunction)set_gil_release, METH_O,
     "set_gil_release(flag): whether launches release the GIL (default True; False only to measure its cost)."},
    {"launch_held", (PyCFunction)(void (*)(void))launch_held, METH_FASTCALL,
     "launch_held(cx, tensors, writes, geom, stream, params) -> CUresult, or -1 (not launched) if cx does not hold every tensor yet."},
    {"held_all", (PyCFunction)(void (*)(void))held_all, METH_FASTCALL,
     "held_all(cx, tensors, writes) -> True if cx already holds every tensor's span (call under the ledger lock)."},
    {"run_planned", (PyCFunction)(void (*)(void))run_planned, METH_FASTCALL,
     "run_planned(cx, fast, args) -> CUresult, or -1 (not launched): a planned elementwise launch in one call."},
    {"lt_matmul", (PyCFunction)(void (*)(void))lt_matmul, METH_FASTCALL,
     "lt_matmul(static, alpha, beta, workspace, workspace_bytes, stream) -> cublasStatus_t."},
    {"run_steps", (PyCFunction)(void (*)(void))run_steps, METH_FASTCALL,
     "run_steps(cx, out, steps, op_type, planned_type, fast) -> (i, value): a chain's step loop."},
    {"set_lock", (PyCFunction)set_lock, METH_O, "set_lock(lock): the ledger lock run_planned takes."},
    {"graph_launch", (PyCFunction)(void (*)(void))graph_launch, METH_FASTCALL, "graph_launch(exec, stream) -> CUresult."},
    {"stream_sync", (PyCFunction)stream_sync, METH_O, "stream_sync(stream) -> CUresult (releases the GIL while waiting)."},
    {"event_record", (PyCFunction)(void (*)(void))event_record, METH_FASTCALL, "event_record(event, stream) -> CUresult."},
    {"event_query", (PyCFunction)event_query, METH_O, "event_query(event) -> CUresult (0: complete, 600: not ready)."},
    {"ledger_release", (PyCFunction)ledger_release, METH_O, "ledger_release(cx): drop a finished execution's access entries (takes the ledger lock)."},
    {"set_launch_maker", (PyCFunction)set_launch_maker, METH_O, "set_launch_maker(maker): how GraphBase.launch() builds its op."},
    {"set_replay", (PyCFunction)(void (*)(void))set_replay, METH_FASTCALL,
     "set_replay(context_maker, capture_state, recording, stream_type, touch, enabled, cuda_error, next_stream, switch): "
     "configure ReplayBase's native replay."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "deviceop._native", "Native launch and completion wake-ups for deviceop.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    const char *names[] = {"acquire", "release", "_used", "_run", "_take", "then", "map", "backend", ".then()",
                           "finish", "scope", "sync_on()", "sync()",
                           "_generic_sync_on", "_generic_sync", "_generic_launch"};
    PyObject **dst[] = {&s_acquire, &s_release, &s_used, &s_run, &s_take, &s_then, &s_map, &s_backend, &s_then_by,
                        &s_finish, &s_scope, &s_lbl_sync_on, &s_lbl_sync,
                        &s_generic_sync_on, &s_generic_sync, &s_generic_launch};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if ((*dst[i] = PyUnicode_InternFromString(names[i])) == NULL) return NULL;
    }
    if ((empty_tuple = PyTuple_New(0)) == NULL) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (dvo_objs_add(m) < 0 || dvo_add_type(m, "Channel", &ChannelType) < 0 || dvo_add_type(m, "Lock", &LockType) < 0 ||
        dvo_add_type(m, "ReplayBase", &ReplayBaseType) < 0 || dvo_add_type(m, "GraphBase", &GraphBaseType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
