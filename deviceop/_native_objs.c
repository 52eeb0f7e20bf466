/* deviceop._native, part 2: building the launch path's small objects without running Python.
 *
 * 1. Maker(type, args, fixed): a factory for instances of a __slots__ class that sets the
 *    slots directly (as the slot descriptors would) instead of running __init__. Used where an
 *    object is built per launch or per replay and __init__'s frame costs as much as the work:
 *    the planned kernel call and the execution context of a graph replay. ``fixed`` comes
 *    from an instance built by the real __init__ (see kernels/_elementwise.py and
 *    executors/_context.py), so the defaults have one source; an empty list there stands for a
 *    fresh empty list per object.
 * 2. KernelFront: the base of the built-in kernel families whose call is the launch path. Its
 *    tp_call makes the planned call op when the arguments are the ones the last plan was made
 *    for (same tensors, plain float scalars, same backend), and otherwise calls the Python
 *    method ``_call_slow(args)``, which validates and plans.
 */
#include "_native.h"

#include <structmember.h>

/* ---- Maker ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyTypeObject *type;
    Py_ssize_t nargs, nfixed;
    Py_ssize_t *off;   /* nargs + nfixed slot offsets */
    PyObject **fixed;  /* nfixed values */
    vectorcallfunc vectorcall;
} MakerObject;

static PyTypeObject MakerType;

Py_ssize_t dvo_member_offset(PyTypeObject *type, PyObject *name) {
    PyObject *d = PyObject_GetAttr((PyObject *)type, name);
    if (d == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    Py_ssize_t off = 0;
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if ((m->type == T_OBJECT_EX || m->type == T_OBJECT) && !(m->flags & READONLY)) off = m->offset;
    }
    Py_DECREF(d);
    return off;
}

/* the offset of writable object slot ``name`` of ``type``, or -1 with an error set */
static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    Py_ssize_t off = dvo_member_offset(type, name);
    if (off == 0) {
        PyErr_Format(PyExc_TypeError, "Maker: %R is not a writable __slots__ member of %s", name, type->tp_name);
        return -1;
    }
    return off;
}

static PyObject *make(MakerObject *mk, PyObject *const *vals) {
    PyTypeObject *t = mk->type;
    PyObject *o = t->tp_alloc(t, 0);
    if (o == NULL) return NULL;
    for (Py_ssize_t i = 0; i < mk->nargs; i++) *(PyObject **)((char *)o + mk->off[i]) = Py_NewRef(vals[i]);
    for (Py_ssize_t j = 0; j < mk->nfixed; j++) {
        PyObject *v = mk->fixed[j];
        if (PyList_CheckExact(v)) {
            v = PyList_New(0);
            if (v == NULL) {
                Py_DECREF(o);
                return NULL;
            }
        } else {
            Py_INCREF(v);
        }
        *(PyObject **)((char *)o + mk->off[mk->nargs + j]) = v;
    }
    return o;
}

PyObject *dvo_make(PyObject *maker, PyObject *const *vals, Py_ssize_t n) {
    if (!Py_IS_TYPE(maker, &MakerType)) {
        PyErr_SetString(PyExc_TypeError, "not a Maker");
        return NULL;
    }
    MakerObject *mk = (MakerObject *)maker;
    if (n != mk->nargs) {
        PyErr_Format(PyExc_TypeError, "this Maker of %s takes %zd arguments, got %zd", mk->type->tp_name, mk->nargs, n);
        return NULL;
    }
    return make(mk, vals);
}

static PyObject *Maker_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_SetString(PyExc_TypeError, "a Maker takes positional arguments only");
        return NULL;
    }
    return dvo_make(self, args, PyVectorcall_NARGS(nargsf));
}

static void Maker_dealloc(MakerObject *self) {
    for (Py_ssize_t j = 0; j < self->nfixed && self->fixed != NULL; j++) Py_XDECREF(self->fixed[j]);
    PyMem_Free(self->fixed);
    PyMem_Free(self->off);
    Py_XDECREF(self->type);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Maker(type, args, fixed): args a tuple of slot names (the call's arguments, in order),
 * fixed a tuple of (slot name, value) pairs. */
static PyObject *Maker_new(PyTypeObject *cls, PyObject *args, PyObject *kw) {
    PyObject *type, *names, *fixed;
    if (!PyArg_ParseTuple(args, "O!O!O!:Maker", &PyType_Type, &type, &PyTuple_Type, &names, &PyTuple_Type, &fixed)) return NULL;
    PyTypeObject *t = (PyTypeObject *)type;
    if (t->tp_itemsize != 0 || t->tp_alloc == NULL) {
        PyErr_Format(PyExc_TypeError, "Maker: %s is not a fixed-size class", t->tp_name);
        return NULL;
    }
    MakerObject *mk = (MakerObject *)cls->tp_alloc(cls, 0);
    if (mk == NULL) return NULL;
    mk->vectorcall = Maker_vectorcall;
    mk->type = (PyTypeObject *)Py_NewRef(type);
    mk->nargs = PyTuple_GET_SIZE(names);
    mk->nfixed = PyTuple_GET_SIZE(fixed);
    mk->off = PyMem_Calloc((size_t)(mk->nargs + mk->nfixed + 1), sizeof(Py_ssize_t));
    mk->fixed = PyMem_Calloc((size_t)(mk->nfixed + 1), sizeof(PyObject *));
    if (mk->off == NULL || mk->fixed == NULL) {
        Py_DECREF(mk);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < mk->nargs; i++) {
        if ((mk->off[i] = slot_offset(t, PyTuple_GET_ITEM(names, i))) < 0) goto fail;
    }
    for (Py_ssize_t j = 0; j < mk->nfixed; j++) {
        PyObject *pair = PyTuple_GET_ITEM(fixed, j);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "Maker: fixed is a tuple of (slot name, value) pairs");
            goto fail;
        }
        PyObject *v = PyTuple_GET_ITEM(pair, 1);
        /* a shared mutable default would be shared by every object made */
        if ((PyList_Check(v) && PyList_GET_SIZE(v) != 0) || PyDict_Check(v) || PyAnySet_Check(v) || PyByteArray_Check(v)) {
            PyErr_Format(PyExc_TypeError, "Maker: the fixed value of %R is mutable (only an empty list, made fresh per object, is allowed)",
                         PyTuple_GET_ITEM(pair, 0));
            goto fail;
        }
        if ((mk->off[mk->nargs + j] = slot_offset(t, PyTuple_GET_ITEM(pair, 0))) < 0) goto fail;
        mk->fixed[j] = Py_NewRef(v);
    }
    return (PyObject *)mk;
fail:
    Py_DECREF(mk);
    return NULL;
}

static PyTypeObject MakerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "deviceop._native.Maker",
    .tp_basicsize = sizeof(MakerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Maker(type, args, fixed): build instances of a __slots__ class without __init__.",
    .tp_new = Maker_new,
    .tp_dealloc = (destructor)Maker_dealloc,
    .tp_vectorcall_offset = offsetof(MakerObject, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ---- KernelFront ----------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *plan;       /* _plan: the last validated plan (refs, be, ...) or None */
    PyObject *make_call;  /* _make_call: Maker of the planned call (_used, _k, _args, _plan) */
    PyObject *selected;   /* _selected: the dict whose "backend" is the selected backend */
    Py_ssize_t n, nt;     /* _n: arguments; _n_t: tensor arguments, the output first */
} FrontObject;

static PyObject *s_be, *s_refs, *s_backend_key, *s_call_slow;

static PyObject *weak_target(PyObject *ref) { /* borrowed; Py_None once dead */
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = NULL;
    if (PyWeakref_GetRef(ref, &o) < 0) {
        PyErr_Clear();
        return Py_None;
    }
    if (o == NULL) return Py_None;
    Py_DECREF(o); /* still referenced by the caller's argument tuple when it matters */
    return o;
#else
    return PyWeakref_GetObject(ref);
#endif
}

/* 1 if ``args`` are what plan ``p`` was made for, 0 if not, -1 on error */
static int planned_ok(FrontObject *self, PyObject *p, PyObject *args) {
    int ok = 0;
    PyObject *be = PyObject_GetAttr(p, s_be);
    if (be == NULL) return -1;
    PyObject *sel = PyDict_GetItemWithError(self->selected, s_backend_key);
    if (sel == NULL && PyErr_Occurred()) {
        Py_DECREF(be);
        return -1;
    }
    if (be != sel) {
        Py_DECREF(be);
        return 0;
    }
    Py_DECREF(be);
    PyObject *refs = PyObject_GetAttr(p, s_refs);
    if (refs == NULL) return -1;
    if (PyTuple_Check(refs) && PyTuple_GET_SIZE(refs) >= self->nt) {
        ok = 1;
        for (Py_ssize_t i = 0; ok && i < self->nt; i++) {
            PyObject *w = PyTuple_GET_ITEM(refs, i);
            ok = PyWeakref_Check(w) && weak_target(w) == PyTuple_GET_ITEM(args, i);
        }
        for (Py_ssize_t i = self->nt; ok && i < self->n; i++) ok = PyFloat_CheckExact(PyTuple_GET_ITEM(args, i));
    }
    Py_DECREF(refs);
    return ok;
}

static PyObject *Front_call(PyObject *op, PyObject *args, PyObject *kw) {
    FrontObject *self = (FrontObject *)op;
    if (kw != NULL && PyDict_GET_SIZE(kw) > 0) {
        PyErr_Format(PyExc_TypeError, "%R takes positional arguments only", op);
        return NULL;
    }
    if (self->plan != NULL && self->plan != Py_None && self->make_call != NULL && self->selected != NULL &&
        PyDict_Check(self->selected) && PyTuple_GET_SIZE(args) == self->n) {
        PyObject *p = Py_NewRef(self->plan);
        int ok = planned_ok(self, p, args);
        PyObject *r = NULL;
        if (ok > 0) {
            PyObject *v[4] = {Py_None, op, args, p};
            r = dvo_make(self->make_call, v, 4);
        }
        Py_DECREF(p);
        if (ok != 0) return r;
    }
    return PyObject_CallMethodOneArg(op, s_call_slow, args);
}

static int Front_traverse(FrontObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->plan);
    Py_VISIT(self->make_call);
    Py_VISIT(self->selected);
    return 0;
}

static int Front_clear(FrontObject *self) {
    Py_CLEAR(self->plan);
    Py_CLEAR(self->make_call);
    Py_CLEAR(self->selected);
    return 0;
}

static void Front_dealloc(FrontObject *self) {
    PyObject_GC_UnTrack(self);
    Front_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Front_members[] = {
    {"_plan", T_OBJECT, offsetof(FrontObject, plan), 0, "the last validated plan, or None"},
    {"_make_call", T_OBJECT, offsetof(FrontObject, make_call), 0, "Maker of the planned call op"},
    {"_selected", T_OBJECT, offsetof(FrontObject, selected), 0, "dict whose 'backend' is the selected backend"},
    {"_n", T_PYSSIZET, offsetof(FrontObject, n), 0, "number of arguments"},
    {"_n_t", T_PYSSIZET, offsetof(FrontObject, nt), 0, "number of tensor arguments (the output first)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FrontType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "deviceop._native.KernelFront",
    .tp_basicsize = sizeof(FrontObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Base of kernel families whose call is the launch path (see _native_objs.c).",
    .tp_new = PyType_GenericNew,
    .tp_call = Front_call,
    .tp_traverse = (traverseproc)Front_traverse,
    .tp_clear = (inquiry)Front_clear,
    .tp_dealloc = (destructor)Front_dealloc,
    .tp_members = Front_members,
};

int dvo_add_type(PyObject *m, const char *name, PyTypeObject *type) {
    if (PyType_Ready(type) < 0) return -1;
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

int dvo_objs_add(PyObject *m) {
    s_be = PyUnicode_InternFromString("be");
    s_refs = PyUnicode_InternFromString("refs");
    s_backend_key = PyUnicode_InternFromString("backend");
    s_call_slow = PyUnicode_InternFromString("_call_slow");
    if (s_be == NULL || s_refs == NULL || s_backend_key == NULL || s_call_slow == NULL) return -1;
    return dvo_add_type(m, "Maker", &MakerType) < 0 || dvo_add_type(m, "KernelFront", &FrontType) < 0 ? -1 : 0;
}
