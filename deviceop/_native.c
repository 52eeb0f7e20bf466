/* deviceop._native: the two places where Python is too slow or must not run.
 *
 * 1. launch(): cuLaunchKernel through the driver's own entry point. cuda.bindings spends
 *    about as long converting its arguments as the driver spends launching; here the caller
 *    passes plain integers it prepared once (function handle, stream handle, parameter block).
 * 2. Channel + notify(): completion wake-ups for `await`. notify() enqueues a C host function
 *    with cuLaunchHostFunc; when the stream reaches it, the function (on the driver's thread,
 *    without the GIL, without any CUDA call) appends a token to the channel's queue and
 *    writes the channel's eventfd. The event loop watches the fd and drains the tokens.
 *
 * The driver is not linked: its entry points are looked up with dlsym in the libcuda that
 * cuda.bindings already loaded (load_driver), so importing this module never needs a GPU.
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

static launch_fn p_launch = NULL;
static hostfunc_fn p_hostfunc = NULL;

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
    if (p_hostfunc == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the CUDA driver is not loaded; call load_driver() first");
        return NULL;
    }
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

/* ---- the driver ------------------------------------------------------------------------ */

static PyObject *load_driver(PyObject *self, PyObject *unused) {
    if (p_launch != NULL && p_hostfunc != NULL) Py_RETURN_TRUE;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == NULL) h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h == NULL) Py_RETURN_FALSE;
    p_launch = (launch_fn)dlsym(h, "cuLaunchKernel");
    p_hostfunc = (hostfunc_fn)dlsym(h, "cuLaunchHostFunc");
    if (p_launch == NULL || p_hostfunc == NULL) {
        p_launch = NULL;
        p_hostfunc = NULL;
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* launch((fn, gx, gy, gz, bx, by, bz, shmem), stream, params) -> CUresult
 * The geometry tuple is built once per launch plan; only the stream varies per call. */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 8) {
        PyErr_SetString(PyExc_TypeError, "launch((fn, gx, gy, gz, bx, by, bz, shmem), stream, params) takes 3 arguments");
        return NULL;
    }
    if (p_launch == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "the CUDA driver is not loaded; call load_driver() first");
        return NULL;
    }
    PyObject *g = args[0];
    void *fn = PyLong_AsVoidPtr(PyTuple_GET_ITEM(g, 0));
    unsigned v[7];
    for (int i = 0; i < 7; i++) v[i] = (unsigned)PyLong_AsUnsignedLong(PyTuple_GET_ITEM(g, 1 + i));
    void *stream = PyLong_AsVoidPtr(args[1]);
    void **params = (void **)PyLong_AsVoidPtr(args[2]);
    if (PyErr_Occurred()) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = p_launch(fn, v[0], v[1], v[2], v[3], v[4], v[5], v[6], stream, params, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
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

static PyMethodDef module_methods[] = {
    {"load_driver", load_driver, METH_NOARGS, "Find cuLaunchKernel / cuLaunchHostFunc in the loaded libcuda; True on success."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "launch((fn, gx, gy, gz, bx, by, bz, shmem), stream, params) -> CUresult (ints; params: a void** address)."},
    {"launch_held", (PyCFunction)(void (*)(void))launch_held, METH_FASTCALL,
     "launch_held(cx, tensors, writes, geom, stream, params) -> CUresult, or -1 (not launched) if cx does not hold every tensor yet."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "deviceop._native", "Native launch and completion wake-ups for deviceop.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&ChannelType) < 0) return NULL;
    s_buffer = PyUnicode_InternFromString("buffer");
    s_accesses = PyUnicode_InternFromString("accesses");
    s_span = PyUnicode_InternFromString("_span");
    if (s_buffer == NULL || s_accesses == NULL || s_span == NULL) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    Py_INCREF(&ChannelType);
    if (PyModule_AddObject(m, "Channel", (PyObject *)&ChannelType) < 0) {
        Py_DECREF(&ChannelType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
