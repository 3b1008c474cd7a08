/* Copies a table of rows between host buffers: one memcpy per row, GIL released.
 *
 * torch's CPU index kernels (index_select, index_copy_) move one element at a time, and
 * every block copy of the CPU tier is a page-sized row at an arbitrary address, so they
 * left a store + load at 0.64x a plain copy of the same bytes (docs/benchmarks.md).
 * Here a row is one memcpy, or, for large batches, a loop of non-temporal stores: they
 * write whole cache lines without first reading the destination, as glibc's memcpy does
 * for a single large copy but never for a 32 KiB row. Threads are the caller's (each
 * calls `copy` on its part of the table); nothing here allocates or keeps state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

static void copy_row(char *dst, const char *src, int64_t nbytes, int nontemporal) {
#if HAVE_STREAM
    if (nontemporal && ((uintptr_t)dst & 15) == 0 && (nbytes & 63) == 0) {
        for (int64_t o = 0; o < nbytes; o += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + o));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + o + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + o + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + o + 48));
            _mm_stream_si128((__m128i *)(dst + o), a);
            _mm_stream_si128((__m128i *)(dst + o + 16), b);
            _mm_stream_si128((__m128i *)(dst + o + 32), c);
            _mm_stream_si128((__m128i *)(dst + o + 48), d);
        }
        return;
    }
#endif
    memcpy(dst, src, (size_t)nbytes);
}

PyDoc_STRVAR(copy_doc,
             "copy(table, nontemporal)\n\n"
             "Copy every row of `table`, a C-contiguous int64 buffer of shape (n, 3) holding\n"
             "(destination address, source address, byte count). The addresses are trusted:\n"
             "the caller derives them from live tensors and checks them first.");

static PyObject *copy(PyObject *self, PyObject *args) {
    PyObject *table;
    int nontemporal;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Op", &table, &nontemporal)) return NULL;
    if (PyObject_GetBuffer(table, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    const char *fmt = view.format ? view.format : "B";
    if (fmt[0] == '<' || fmt[0] == '=' || fmt[0] == '@') fmt++;
    if (view.itemsize != 8 || (strcmp(fmt, "q") && strcmp(fmt, "l")) || view.ndim != 2 ||
        view.shape[1] != 3) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "table must be a C-contiguous int64 (n, 3) buffer");
        return NULL;
    }
    const int64_t *rows = (const int64_t *)view.buf;
    Py_ssize_t n = view.shape[0];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[3 * i + 2] < 0) { /* memcpy would take it for a size near 2**64 */
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "row %zd copies a negative byte count", i);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        copy_row((char *)(intptr_t)rows[3 * i], (const char *)(intptr_t)rows[3 * i + 1],
                 rows[3 * i + 2], nontemporal);
    }
#if HAVE_STREAM
    if (nontemporal) _mm_sfence(); /* streamed lines are visible before we return */
#endif
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "hybridkv._rowcopy", "Row copies between host buffers.", -1, methods,
};

PyMODINIT_FUNC PyInit__rowcopy(void) { return PyModule_Create(&module); }
