/* Internal to _ops (rows.c, sampling.c, module.c): the Python bindings each file gives the module's method table.
 * The files share one tape state pointer (KILN_TAPE_STATE_EXTERN; module.c defines it). */
#ifndef KILN_OPS_H
#define KILN_OPS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define KILN_TAPE_STATE_EXTERN
#include "../common.h"
#include "../numeric.h"

/* rows.c: row-wise float32 kernels */
PyObject *py_rms_norm(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_add_rms_norm(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_silu_mul(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_gelu_tanh_mul(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_scale(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_add(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_gather_rows(PyObject *Py_UNUSED(self), PyObject *args);

/* sampling.c: greedy picks, the exponential race and grammar masks */
PyObject *py_argmax_rows(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_race_rows(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_race_noise(PyObject *Py_UNUSED(self), PyObject *args);
PyObject *py_mask_rows_bits(PyObject *Py_UNUSED(self), PyObject *args);

#endif
