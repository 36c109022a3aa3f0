// memanat._native: the CPython extension over bind/memanat_api.c (memanat.h inside). One
// function, call(op, request) -> (code, text): code 0 and the answer's JSON, or a negative
// mn_result and the library's one-line message; memanat/__init__.py turns the latter into an
// exception. Built against the stable ABI of CPython 3.9 (one wheel serves 3.9 and later); the
// estimate runs with the GIL released, since the library keeps no state between calls.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "bind/memanat_api.h"

static PyObject *native_call(PyObject *self, PyObject *args) {
    const char *op, *req;
    Py_ssize_t len;
    char *out = NULL;
    size_t out_len = 0;
    int rc;
    PyObject *res;
    (void)self;
    if (!PyArg_ParseTuple(args, "ss#:call", &op, &req, &len)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = mn_api_call(op, req, (size_t)len, &out, &out_len);
    Py_END_ALLOW_THREADS
    if (!out) return PyErr_NoMemory();
    res = Py_BuildValue("(iy#)", rc, out, (Py_ssize_t)out_len);
    mn_api_free(out);
    return res;
}

static PyMethodDef native_methods[] = {
    {"call", native_call, METH_VARARGS,
     "call(op, request_json) -> (code, utf8_bytes): one memanat_api operation."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "memanat._native", "memanat.h compiled for CPython.", -1,
    native_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
