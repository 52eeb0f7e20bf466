/* deviceop._native: what its C files share. */
#ifndef DEVICEOP_NATIVE_H
#define DEVICEOP_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* _native_objs.c: object factories and the kernel front (see that file) */

/* A new object from a Maker (``Maker(type, args, fixed)``) with ``vals`` for its argument slots;
 * NULL with an error set if ``maker`` is not a Maker or ``n`` is not its argument count. */
PyObject *dvo_make(PyObject *maker, PyObject *const *vals, Py_ssize_t n);

/* The offset of ``name`` in instances of ``type`` if it is a writable object slot (__slots__
 * member), 0 if it is anything else, -1 with an error set if the lookup failed. */
Py_ssize_t dvo_member_offset(PyTypeObject *type, PyObject *name);

/* Ready ``type`` and add it to module ``m`` as ``name``; 0 on success. */
int dvo_add_type(PyObject *m, const char *name, PyTypeObject *type);

/* Add Maker and KernelFront to the module; 0 on success. */
int dvo_objs_add(PyObject *m);

#endif
