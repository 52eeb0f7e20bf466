/* deviceop._native: the places where Python is too slow or must not run.
 *
 * 1. Launch paths: launch() (cuLaunchKernel with a geometry packed once per plan),
 *    run_planned() (a planned elementwise launch: parameter check, ledger "already held"
 *    check and launch under the ledger lock, in one call), run_steps() (the step loop of a
 *    then/map chain, which launches planned calls directly), lt_matmul() (cublasLtMatmul),
 *    graph_launch(), event_record/event_query(), stream_sync(). cuda.bindings spends about as
 *    long converting its arguments as the driver spends launching; here callers pass plain
 *    integers prepared once.
 * 2. Lock: the ledger lock, which these paths take without a Python method call.
 * 3. Channel + notify(): completion wake-ups for `await`. notify() enqueues a C host function
 *    with cuLaunchHostFunc; when the stream reaches it, the function (on the driver's thread,
 *    without the GIL, without any CUDA call) appends a token to the channel's queue and
 *    writes the channel's eventfd. The event loop watches the fd and drains the tokens.
 *
 * The driver is not linked: its entry points are looked up with dlsym in the libcuda that
 * cuda.bindings already loaded (load_driver), and cublasLtMatmul's address comes from the
 * library nvmath loaded, so importing this module never needs a GPU.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
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

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    int locked;
} LockObject;

static PyTypeObject LockType;

/* Take the lock with the GIL held; waits (GIL released) if another thread has it. */
static int lock_take(LockObject *l) {
    if (!PyThread_acquire_lock(l->lock, NOWAIT_LOCK)) {
        int ok;
        Py_BEGIN_ALLOW_THREADS
        ok = PyThread_acquire_lock(l->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
        if (!ok) {
            PyErr_SetString(PyExc_RuntimeError, "could not take the lock");
            return -1;
        }
    }
    l->locked = 1;
    return 0;
}

static int lock_give(LockObject *l) {
    if (!l->locked) {
        PyErr_SetString(PyExc_RuntimeError, "release of an unlocked lock");
        return -1;
    }
    l->locked = 0;
    PyThread_release_lock(l->lock);
    return 0;
}

static int Lock_init(LockObject *self, PyObject *args, PyObject *kw) {
    if (self->lock == NULL) self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void Lock_dealloc(LockObject *self) {
    if (self->lock != NULL) {
        if (self->locked) PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
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
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lock_init,
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
    if (p_launch == NULL || p_hostfunc == NULL || p_graph_launch == NULL || p_ev_record == NULL || p_ev_query == NULL ||
        p_stream_sync == NULL) {
        p_launch = NULL;
        p_hostfunc = NULL;
        p_graph_launch = NULL;
        p_ev_record = NULL;
        p_ev_query = NULL;
        p_stream_sync = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
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

static PyObject *s_buffer, *s_accesses, *s_span;

/* 1 if the execution ``cx`` already holds tensor ``t``'s byte span (with ``write`` if asked):
 * the last entry of its buffer's access list is cx's and covers the span. Mirrors the
 * Python fast check in kernels/_launch.py; anything else goes to the ledger's full path. */
static int held(PyObject *cx, PyObject *t, int write) {
    int ok = 0;
    PyObject *buf = PyObject_GetAttr(t, s_buffer);
    if (buf == NULL) return -1;
    PyObject *acc = PyObject_GetAttr(buf, s_accesses);
    Py_DECREF(buf);
    if (acc == NULL) return -1;
    PyObject *span = PyObject_GetAttr(t, s_span);
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

static PyObject *s_tensor, *s_sh, *s_fast, *s_last_ptrs, *s_last_scalars, *s_acquire, *s_release;

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
        PyObject *t = i == 0 ? PyObject_GetAttr(PyTuple_GET_ITEM(a, 0), s_tensor) : PyTuple_GET_ITEM(a, i);
        if (t == NULL) return NULL;
        int h = held(cx, t, PyTuple_GET_ITEM(writes, i) == Py_True);
        if (i == 0) Py_DECREF(t);
        if (h <= 0) return h < 0 ? NULL : PyLong_FromLong(-1);
    }
    PyObject *rest[3] = {geom, PyObject_GetAttr(cx, s_sh), addr};
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
    lp = PyObject_GetAttr(packer, s_last_ptrs);
    ls = PyObject_GetAttr(packer, s_last_scalars);
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
        native_lock->locked = 0;
        PyThread_release_lock(native_lock->lock);
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

static PyObject *s_used, *s_run, *s_take, *s_then, *s_map, *s_plan, *s_backend, *s_args, *s_then_by;

/* The planned fast path of one op inside run_steps: the op's output (its args), or NULL with
 * no error set when the generic path must run it. */
static PyObject *try_planned(PyObject *cx, PyObject *op) {
    PyObject *p = PyObject_GetAttr(op, s_plan);
    if (p == NULL) return NULL;
    PyObject *fast = PyObject_GetAttr(p, s_fast);
    Py_DECREF(p);
    if (fast == NULL) return NULL;
    PyObject *out = NULL, *cbe = NULL, *a = NULL;
    if (!PyTuple_Check(fast) || PyTuple_GET_SIZE(fast) != 7) goto done;  /* None: not a cuda plan */
    cbe = PyObject_GetAttr(cx, s_backend);
    if (cbe == NULL || cbe != PyTuple_GET_ITEM(fast, 6)) goto done;
    a = PyObject_GetAttr(op, s_args);
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
            PyObject *used = PyObject_GetAttr(v, s_used);
            if (used == NULL) {
                Py_DECREF(v);
                goto fail;
            }
            int ok;
            if (used == Py_None) {
                ok = PyObject_SetAttr(v, s_used, s_then_by) == 0;
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
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "deviceop._native", "Native launch and completion wake-ups for deviceop.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ChannelType) < 0) return NULL;
    if (PyType_Ready(&LockType) < 0) return NULL;
    s_buffer = PyUnicode_InternFromString("buffer");
    s_accesses = PyUnicode_InternFromString("accesses");
    s_span = PyUnicode_InternFromString("_span");
    if (s_buffer == NULL || s_accesses == NULL || s_span == NULL) return NULL;
    s_tensor = PyUnicode_InternFromString("tensor");
    s_sh = PyUnicode_InternFromString("sh");
    s_fast = PyUnicode_InternFromString("fast");
    s_last_ptrs = PyUnicode_InternFromString("last_ptrs");
    s_last_scalars = PyUnicode_InternFromString("last_scalars");
    s_acquire = PyUnicode_InternFromString("acquire");
    s_release = PyUnicode_InternFromString("release");
    s_used = PyUnicode_InternFromString("_used");
    s_run = PyUnicode_InternFromString("_run");
    s_take = PyUnicode_InternFromString("_take");
    s_then = PyUnicode_InternFromString("then");
    s_map = PyUnicode_InternFromString("map");
    s_plan = PyUnicode_InternFromString("_plan");
    s_backend = PyUnicode_InternFromString("backend");
    s_args = PyUnicode_InternFromString("_args");
    s_then_by = PyUnicode_InternFromString(".then()");
    if (s_used == NULL || s_run == NULL || s_take == NULL || s_then == NULL || s_map == NULL || s_plan == NULL ||
        s_backend == NULL || s_args == NULL || s_then_by == NULL)
        return NULL;
    if (s_tensor == NULL || s_sh == NULL || s_fast == NULL || s_last_ptrs == NULL || s_last_scalars == NULL ||
        s_acquire == NULL || s_release == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&ChannelType);
    if (PyModule_AddObject(m, "Channel", (PyObject *)&ChannelType) < 0) {
        Py_DECREF(&ChannelType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LockType);
    if (PyModule_AddObject(m, "Lock", (PyObject *)&LockType) < 0) {
        Py_DECREF(&LockType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
