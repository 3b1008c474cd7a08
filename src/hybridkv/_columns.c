/* Column: a growable column of machine numbers (or short keys) kept in fixed pages.
 *
 * The scheduler side keeps a row per boundary, segment and orphan entry in columns
 * (core/boundary_graph.py, core/recency.py). In an `array.array` every column of a table
 * reaches its allocation's end on the same append, and growing it copies the whole column
 * into memory the process touches for the first time: the boundaries' 17 columns grown
 * to 100,000 rows took up to 2.4-3.7 ms for one row, to a million 12-13 ms, on vLLM's
 * scheduler thread (`bench/lookup.py --row-growth`, docs/benchmarks.md). Here a column
 * grows a page of 4,096 items at a time, the old pages never move, so an append costs the
 * same at any size (at most 0.3-0.6 ms there, and p50 unchanged). Indexing is what an array's costs: one call, a shift and a
 * mask, no Python object held per item (the garbage collector does not track a column).
 *
 * Kinds: 'q' int64, 'd' double, 'b' int8, 'k' a byte string of at most 23 bytes (kept
 * as its length, then its bytes, in 24).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define PAGE_SHIFT 12
#define PAGE_ITEMS ((Py_ssize_t)1 << PAGE_SHIFT)
#define KEY_ROOM 24

typedef struct {
    PyObject_HEAD
    char kind;
    Py_ssize_t item; /* bytes an item takes */
    Py_ssize_t len;
    Py_ssize_t npages;
    Py_ssize_t cap;  /* room in `pages` */
    char **pages;
} Column;

static inline char *at(Column *c, Py_ssize_t i) {
    return c->pages[i >> PAGE_SHIFT] + (i & (PAGE_ITEMS - 1)) * c->item;
}

static PyObject *get(Column *c, Py_ssize_t i) {
    char *p = at(c, i);
    switch (c->kind) {
    case 'q':
        return PyLong_FromLongLong(*(long long *)p);
    case 'd':
        return PyFloat_FromDouble(*(double *)p);
    case 'b':
        return PyLong_FromLong(*(signed char *)p);
    default:
        return PyBytes_FromStringAndSize(p + 1, (unsigned char)p[0]);
    }
}

/* A value converted for a column's kind. Converting can run Python code (an object's
 * `__index__` or `__float__`), which could change the column itself, so every caller
 * converts first and only then finds the item's place and writes it, with no Python code
 * in between: a refused value changes nothing, and a column changed meanwhile is
 * written where it is now. `key` points into the value, which the caller holds. */
typedef struct {
    long long q;
    double d;
    const char *key;
    Py_ssize_t n;
} Value;

static int convert(Column *c, PyObject *v, Value *out) {
    char *key = NULL;
    switch (c->kind) {
    case 'q':
        out->q = PyLong_AsLongLong(v);
        return out->q == -1 && PyErr_Occurred() ? -1 : 0;
    case 'd':
        out->d = PyFloat_AsDouble(v);
        return out->d == -1.0 && PyErr_Occurred() ? -1 : 0;
    case 'b':
        out->q = PyLong_AsLongLong(v);
        if (out->q == -1 && PyErr_Occurred())
            return -1;
        if (out->q < -128 || out->q > 127) {
            PyErr_SetString(PyExc_OverflowError, "a 'b' column holds -128..127");
            return -1;
        }
        return 0;
    default:
        if (PyBytes_AsStringAndSize(v, &key, &out->n) < 0)
            return -1;
        if (out->n >= KEY_ROOM) {
            PyErr_SetString(PyExc_ValueError, "a 'k' column holds keys of at most 23 bytes");
            return -1;
        }
        out->key = key;
        return 0;
    }
}

static void put(Column *c, Py_ssize_t i, const Value *v) {
    char *p = at(c, i);
    switch (c->kind) {
    case 'q':
        *(long long *)p = v->q;
        break;
    case 'd':
        *(double *)p = v->d;
        break;
    case 'b':
        *(signed char *)p = (signed char)v->q;
        break;
    default:
        p[0] = (char)v->n;
        memcpy(p + 1, v->key, v->n);
    }
}

/* Room for one more item: a new page when the last is full. */
static int reserve(Column *c) {
    if (c->len < c->npages * PAGE_ITEMS)
        return 0;
    if (c->npages == c->cap) {
        Py_ssize_t cap = c->cap ? 2 * c->cap : 4;
        char **pages = PyMem_Realloc(c->pages, cap * sizeof(char *));
        if (!pages) {
            PyErr_NoMemory();
            return -1;
        }
        c->pages = pages;
        c->cap = cap;
    }
    char *page = PyMem_Calloc(PAGE_ITEMS, c->item);
    if (!page) {
        PyErr_NoMemory();
        return -1;
    }
    c->pages[c->npages++] = page;
    return 0;
}

static int index_of(Column *c, PyObject *key, Py_ssize_t *i) {
    Py_ssize_t k = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (k == -1 && PyErr_Occurred())
        return -1;
    if (k < 0)
        k += c->len;
    if (k < 0 || k >= c->len) {
        PyErr_SetString(PyExc_IndexError, "column index out of range");
        return -1;
    }
    *i = k;
    return 0;
}

static PyObject *Column_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"kind", NULL};
    const char *kind;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s", names, &kind))
        return NULL;
    Py_ssize_t item;
    switch (kind[0]) {
    case 'q':
    case 'd':
        item = 8;
        break;
    case 'b':
        item = 1;
        break;
    case 'k':
        item = KEY_ROOM;
        break;
    default:
        item = 0;
    }
    if (!item || kind[1]) {
        PyErr_Format(PyExc_ValueError, "column kind is one of q, d, b, k: not '%s'", kind);
        return NULL;
    }
    Column *c = (Column *)type->tp_alloc(type, 0);
    if (!c)
        return NULL;
    c->kind = kind[0];
    c->item = item;
    return (PyObject *)c;
}

static void release(Column *c) {
    for (Py_ssize_t p = 0; p < c->npages; p++)
        PyMem_Free(c->pages[p]);
    PyMem_Free(c->pages);
    c->pages = NULL;
    c->npages = c->cap = c->len = 0;
}

static void Column_dealloc(Column *c) {
    release(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static Py_ssize_t Column_len(Column *c) { return c->len; }

static PyObject *Column_item(Column *c, Py_ssize_t i) {
    if (i < 0 || i >= c->len) {
        PyErr_SetString(PyExc_IndexError, "column index out of range");
        return NULL;
    }
    return get(c, i);
}

static PyObject *Column_subscript(Column *c, PyObject *key) {
    Py_ssize_t i;
    if (index_of(c, key, &i) < 0)
        return NULL;
    return get(c, i);
}

static int Column_ass_subscript(Column *c, PyObject *key, PyObject *v) {
    if (!v) {
        PyErr_SetString(PyExc_TypeError, "a column's items cannot be deleted (clear, pop)");
        return -1;
    }
    Value value;
    Py_ssize_t i;
    if (convert(c, v, &value) < 0 || index_of(c, key, &i) < 0)
        return -1;
    put(c, i, &value);
    return 0;
}

static PyObject *Column_append(Column *c, PyObject *v) {
    Value value;
    if (convert(c, v, &value) < 0 || reserve(c) < 0)
        return NULL;
    put(c, c->len++, &value);
    Py_RETURN_NONE;
}

static PyObject *Column_extend(Column *c, PyObject *iterable) {
    /* Its own items are taken first: iterating a column while appending to it never ends. */
    PyObject *items = (PyObject *)c == iterable ? PySequence_List(iterable) : NULL;
    if ((PyObject *)c == iterable && !items)
        return NULL;
    PyObject *it = PyObject_GetIter(items ? items : iterable);
    Py_XDECREF(items); /* the iterator holds the list */
    if (!it)
        return NULL;
    PyObject *v;
    while ((v = PyIter_Next(it))) {
        PyObject *r = Column_append(c, v);
        Py_DECREF(v);
        if (!r) {
            Py_DECREF(it);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_DECREF(it);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Column_pop(Column *c, PyObject *unused) {
    if (!c->len) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty column");
        return NULL;
    }
    PyObject *v = get(c, c->len - 1);
    if (v)
        c->len--;
    return v;
}

static PyObject *Column_clear(Column *c, PyObject *unused) {
    release(c);
    Py_RETURN_NONE;
}

static PyMethodDef Column_methods[] = {
    {"append", (PyCFunction)Column_append, METH_O, "Add an item at the end."},
    {"extend", (PyCFunction)Column_extend, METH_O, "Append each item of an iterable."},
    {"pop", (PyCFunction)Column_pop, METH_NOARGS, "Remove and return the last item."},
    {"clear", (PyCFunction)Column_clear, METH_NOARGS, "Remove every item, freeing the pages."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Column_as_sequence = {
    .sq_length = (lenfunc)Column_len,
    .sq_item = (ssizeargfunc)Column_item,
};

static PyMappingMethods Column_as_mapping = {
    .mp_length = (lenfunc)Column_len,
    .mp_subscript = (binaryfunc)Column_subscript,
    .mp_ass_subscript = (objobjargproc)Column_ass_subscript,
};

static PyTypeObject ColumnType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hybridkv._columns.Column",
    .tp_basicsize = sizeof(Column),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Column(kind): machine numbers ('q', 'd', 'b') or short keys ('k') in fixed "
              "pages of 4096 items.",
    .tp_new = Column_new,
    .tp_dealloc = (destructor)Column_dealloc,
    .tp_methods = Column_methods,
    .tp_as_sequence = &Column_as_sequence,
    .tp_as_mapping = &Column_as_mapping,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_columns", "Columns in fixed pages (Column).", -1, NULL,
};

PyMODINIT_FUNC PyInit__columns(void) {
    if (PyType_Ready(&ColumnType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&ColumnType);
    if (PyModule_AddObject(m, "Column", (PyObject *)&ColumnType) < 0) {
        Py_DECREF(&ColumnType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
