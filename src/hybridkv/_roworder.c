/* RowOrder: row ids sorted by a float key, ties by a sequence number: the eviction
 * orders of core/boundary_order.py and core/eviction.py, which hold every boundary in CPU
 * memory (a hundred thousand at a million entries) and change at every admission, use,
 * pin and eviction of one, on vLLM's scheduler thread.
 *
 * Why native: the same structure in Python (sorted chunks in `array.array`s, bisected
 * with `bisect`) cost a few microseconds per change in interpreted bookkeeping around a
 * memmove of one chunk, and the orders change tens of times in a step that stores or
 * evicts a long prompt (11 % of such a step, bench/lookup.py). Here a change is two
 * bisections and one memmove, with no Python object made.
 *
 * Layout (sortedcontainers'): sorted chunks of at most 2 * load items, each an array of
 * (key, seq, row); the outer bisection reads each chunk's last item. A chunk past 2 *
 * load splits in two; one below load / 2 takes items from the next. (key, seq) is unique
 * (seq is a boundary's admission number); nothing here holds a Python object, so the
 * garbage collector does not track an order. An iterator raises RuntimeError if the
 * order changed since it was made (as a dict's does), so it never reads freed chunks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

typedef struct {
    double key;
    long long seq;
    long long row;
} Item;

typedef struct {
    Py_ssize_t n;
    Item items[]; /* room for 2 * load + 1 */
} Chunk;

typedef struct {
    PyObject_HEAD
    Chunk **chunks;
    Py_ssize_t count; /* chunks in use, none of them empty */
    Py_ssize_t cap;   /* room in `chunks` */
    Py_ssize_t len;
    Py_ssize_t load;
    unsigned long long version; /* bumped by every change */
} RowOrder;

static inline int before(const Item *a, double key, long long seq) {
    return a->key < key || (a->key == key && a->seq < seq);
}

static Chunk *new_chunk(RowOrder *o) {
    Chunk *c = PyMem_Malloc(sizeof(Chunk) + (size_t)(2 * o->load + 1) * sizeof(Item));
    if (!c) {
        PyErr_NoMemory();
        return NULL;
    }
    c->n = 0;
    return c;
}

/* Put `c` at chunk index i; -1 (and `c` freed) without memory. */
static int insert_chunk(RowOrder *o, Py_ssize_t i, Chunk *c) {
    if (o->count == o->cap) {
        Py_ssize_t cap = o->cap ? 2 * o->cap : 4;
        Chunk **grown = PyMem_Realloc(o->chunks, (size_t)cap * sizeof(Chunk *));
        if (!grown) {
            PyMem_Free(c);
            PyErr_NoMemory();
            return -1;
        }
        o->chunks = grown;
        o->cap = cap;
    }
    memmove(&o->chunks[i + 1], &o->chunks[i], (size_t)(o->count - i) * sizeof(Chunk *));
    o->chunks[i] = c;
    o->count++;
    return 0;
}

static void drop_chunk(RowOrder *o, Py_ssize_t i) {
    PyMem_Free(o->chunks[i]);
    memmove(&o->chunks[i], &o->chunks[i + 1], (size_t)(o->count - i - 1) * sizeof(Chunk *));
    o->count--;
}

/* The first chunk whose last item is not before (key, seq), the last chunk if none is
 * (o->count > 0); then the first place in it not before (key, seq). The only chunk may
 * be empty (the first `add`): its place is 0, and it has no last item to read. */
static void find(RowOrder *o, double key, long long seq, Py_ssize_t *chunk, Py_ssize_t *at) {
    if (o->count == 1 && o->chunks[0]->n == 0) {
        *chunk = *at = 0;
        return;
    }
    Py_ssize_t lo = 0, hi = o->count;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        Chunk *c = o->chunks[mid];
        if (before(&c->items[c->n - 1], key, seq))
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == o->count)
        lo--;
    Chunk *c = o->chunks[lo];
    Py_ssize_t l = 0, h = c->n;
    while (l < h) {
        Py_ssize_t mid = (l + h) / 2;
        if (before(&c->items[mid], key, seq))
            l = mid + 1;
        else
            h = mid;
    }
    *chunk = lo;
    *at = l;
}

static int parse_key(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, double *key,
                     long long *seq) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    *key = PyFloat_AsDouble(args[0]);
    if (*key == -1.0 && PyErr_Occurred())
        return -1;
    if (isnan(*key)) { /* unordered: every bisection past it would go astray */
        PyErr_SetString(PyExc_ValueError, "a NaN key has no place in the order");
        return -1;
    }
    *seq = PyLong_AsLongLong(args[1]);
    if (*seq == -1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* (key, seq) from the arguments, and its place (`find`): -1 on a bad argument, 0 in an
 * empty order (no place), 1 with `chunk` and `at` set. */
static int locate(RowOrder *o, PyObject *const *args, Py_ssize_t nargs, double *key,
                  long long *seq, Py_ssize_t *chunk, Py_ssize_t *at) {
    if (parse_key(args, nargs, 2, key, seq) < 0)
        return -1;
    if (!o->count)
        return 0;
    find(o, *key, *seq, chunk, at);
    return 1;
}

static PyObject *item_tuple(const Item *it) {
    return Py_BuildValue("(dLL)", it->key, it->seq, it->row);
}

/* ---- the type ---------------------------------------------------------------------- */

static PyObject *RowOrder_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *names[] = {"load", NULL};
    Py_ssize_t load = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n", names, &load))
        return NULL;
    if (load < 1 || load > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "load must be in [1, 2**20], got %zd", load);
        return NULL;
    }
    RowOrder *o = (RowOrder *)type->tp_alloc(type, 0);
    if (!o)
        return NULL;
    o->chunks = NULL;
    o->count = o->cap = o->len = 0;
    o->load = load;
    o->version = 0;
    return (PyObject *)o;
}

static void release(RowOrder *o) {
    for (Py_ssize_t i = 0; i < o->count; i++)
        PyMem_Free(o->chunks[i]);
    o->count = 0;
    o->len = 0;
    o->version++;
}

static void RowOrder_dealloc(RowOrder *o) {
    release(o);
    PyMem_Free(o->chunks);
    Py_TYPE(o)->tp_free((PyObject *)o);
}

static Py_ssize_t RowOrder_len(RowOrder *o) { return o->len; }

static PyObject *RowOrder_add(RowOrder *o, PyObject *const *args, Py_ssize_t nargs) {
    double key;
    long long seq;
    if (parse_key(args, nargs, 3, &key, &seq) < 0)
        return NULL;
    long long row = PyLong_AsLongLong(args[2]);
    if (row == -1 && PyErr_Occurred())
        return NULL;
    if (!o->count) {
        Chunk *c = new_chunk(o);
        if (!c || insert_chunk(o, 0, c) < 0)
            return NULL;
    }
    Py_ssize_t i, at;
    find(o, key, seq, &i, &at);
    Chunk *c = o->chunks[i];
    if (c->n == 2 * o->load) {
        /* Full: split first (the item goes into one half), so no chunk ever passes its
         * room, whatever fails. */
        Chunk *right = new_chunk(o);
        if (!right)
            return NULL;
        right->n = c->n - o->load;
        memcpy(right->items, &c->items[o->load], (size_t)right->n * sizeof(Item));
        if (insert_chunk(o, i + 1, right) < 0)
            return NULL;
        c->n = o->load;
        o->version++;
        if (at > c->n) {
            at -= c->n;
            c = right;
        }
    }
    memmove(&c->items[at + 1], &c->items[at], (size_t)(c->n - at) * sizeof(Item));
    c->items[at] = (Item){key, seq, row};
    c->n++;
    o->len++;
    o->version++;
    Py_RETURN_NONE;
}

static PyObject *RowOrder_remove(RowOrder *o, PyObject *const *args, Py_ssize_t nargs) {
    double key;
    long long seq;
    Py_ssize_t i, at;
    int found = locate(o, args, nargs, &key, &seq, &i, &at);
    if (found < 0)
        return NULL;
    if (!found || at == o->chunks[i]->n || o->chunks[i]->items[at].key != key ||
        o->chunks[i]->items[at].seq != seq) {
        PyObject *missing = Py_BuildValue("(dL)", key, seq);
        if (missing) {
            PyErr_SetObject(PyExc_KeyError, missing);
            Py_DECREF(missing);
        }
        return NULL;
    }
    Chunk *c = o->chunks[i];
    memmove(&c->items[at], &c->items[at + 1], (size_t)(c->n - at - 1) * sizeof(Item));
    c->n--;
    o->len--;
    o->version++;
    if (!c->n) {
        drop_chunk(o, i);
    } else if (c->n < o->load / 2 && i + 1 < o->count) {
        /* Take items from the next chunk: all of them if they fit in 2 * load, else up
         * to load here. */
        Chunk *next = o->chunks[i + 1];
        Py_ssize_t take = c->n + next->n <= 2 * o->load ? next->n : o->load - c->n;
        memcpy(&c->items[c->n], next->items, (size_t)take * sizeof(Item));
        c->n += take;
        next->n -= take;
        if (next->n)
            memmove(next->items, &next->items[take], (size_t)next->n * sizeof(Item));
        else
            drop_chunk(o, i + 1);
    }
    Py_RETURN_NONE;
}

static PyObject *RowOrder_position(RowOrder *o, PyObject *const *args, Py_ssize_t nargs) {
    double key;
    long long seq;
    Py_ssize_t i, at, n = 0;
    int found = locate(o, args, nargs, &key, &seq, &i, &at);
    if (found <= 0)
        return found < 0 ? NULL : PyLong_FromLong(0);
    if (2 * i <= o->count) {
        for (Py_ssize_t j = 0; j < i; j++)
            n += o->chunks[j]->n;
        return PyLong_FromSsize_t(n + at);
    }
    for (Py_ssize_t j = i; j < o->count; j++)
        n += o->chunks[j]->n;
    return PyLong_FromSsize_t(o->len - n + at);
}

static PyObject *RowOrder_row_at(RowOrder *o, PyObject *arg) {
    Py_ssize_t position = PyLong_AsSsize_t(arg);
    if (position == -1 && PyErr_Occurred())
        return NULL;
    if (position >= 0) {
        for (Py_ssize_t j = 0; j < o->count; j++) {
            if (position < o->chunks[j]->n)
                return PyLong_FromLongLong(o->chunks[j]->items[position].row);
            position -= o->chunks[j]->n;
        }
    }
    PyErr_SetObject(PyExc_IndexError, arg);
    return NULL;
}

static PyObject *RowOrder_first(RowOrder *o, PyObject *unused) {
    if (!o->count) {
        PyErr_SetString(PyExc_IndexError, "first of an empty RowOrder");
        return NULL;
    }
    return item_tuple(&o->chunks[0]->items[0]);
}

static PyObject *RowOrder_last(RowOrder *o, PyObject *unused) {
    if (!o->count) {
        PyErr_SetString(PyExc_IndexError, "last of an empty RowOrder");
        return NULL;
    }
    Chunk *c = o->chunks[o->count - 1];
    return item_tuple(&c->items[c->n - 1]);
}

static PyObject *RowOrder_rows_between(RowOrder *o, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "expected 2 arguments, got %zd", nargs);
        return NULL;
    }
    double lo = PyFloat_AsDouble(args[0]), hi;
    if (lo == -1.0 && PyErr_Occurred())
        return NULL;
    hi = PyFloat_AsDouble(args[1]);
    if (hi == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out || !o->count)
        return out;
    /* The first chunk whose last key is not below lo. */
    Py_ssize_t a = 0, b = o->count;
    while (a < b) {
        Py_ssize_t mid = (a + b) / 2;
        Chunk *c = o->chunks[mid];
        if (c->items[c->n - 1].key < lo)
            a = mid + 1;
        else
            b = mid;
    }
    /* Only ints (which no collection follows) are made here: no Python code runs. */
    for (Py_ssize_t j = a; j < o->count; j++) {
        Chunk *c = o->chunks[j];
        for (Py_ssize_t k = 0; k < c->n; k++) {
            if (c->items[k].key > hi)
                return out;
            if (c->items[k].key < lo)
                continue;
            PyObject *row = PyLong_FromLongLong(c->items[k].row);
            if (!row || PyList_Append(out, row) < 0) {
                Py_XDECREF(row);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(row);
        }
    }
    return out;
}

static PyObject *RowOrder_clear(RowOrder *o, PyObject *unused) {
    release(o);
    Py_RETURN_NONE;
}

/* ---- iterators --------------------------------------------------------------------- */

enum { ITEMS, ROWS, REVERSED };

typedef struct {
    PyObject_HEAD
    RowOrder *order;
    int mode;
    Py_ssize_t chunk, at; /* the next item's place (REVERSED: counted from the end) */
    unsigned long long version;
} RowOrderIter;

static PyTypeObject RowOrderIterType;

static PyObject *make_iter(RowOrder *o, int mode) {
    RowOrderIter *it = PyObject_New(RowOrderIter, &RowOrderIterType);
    if (!it)
        return NULL;
    Py_INCREF(o);
    it->order = o;
    it->mode = mode;
    it->chunk = it->at = 0;
    it->version = o->version;
    return (PyObject *)it;
}

static void RowOrderIter_dealloc(RowOrderIter *it) {
    Py_DECREF(it->order);
    PyObject_Free(it);
}

static PyObject *RowOrderIter_next(RowOrderIter *it) {
    RowOrder *o = it->order;
    if (it->version != o->version) {
        PyErr_SetString(PyExc_RuntimeError, "RowOrder changed during iteration");
        return NULL;
    }
    while (it->chunk < o->count) {
        Chunk *c = o->chunks[it->mode == REVERSED ? o->count - 1 - it->chunk : it->chunk];
        if (it->at < c->n) {
            Item *item = &c->items[it->mode == REVERSED ? c->n - 1 - it->at : it->at];
            it->at++;
            if (it->mode == ROWS)
                return PyLong_FromLongLong(item->row);
            if (it->mode == REVERSED)
                return Py_BuildValue("(dL)", item->key, item->row);
            return item_tuple(item);
        }
        it->chunk++;
        it->at = 0;
    }
    return NULL;
}

static PyTypeObject RowOrderIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hybridkv._roworder.RowOrderIterator",
    .tp_basicsize = sizeof(RowOrderIter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)RowOrderIter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)RowOrderIter_next,
};

static PyObject *RowOrder_iter(RowOrder *o) { return make_iter(o, ITEMS); }

static PyObject *RowOrder_rows(RowOrder *o, PyObject *unused) { return make_iter(o, ROWS); }

static PyObject *RowOrder_rows_reversed(RowOrder *o, PyObject *unused) {
    return make_iter(o, REVERSED);
}

static PyMethodDef RowOrder_methods[] = {
    {"add", (PyCFunction)(void (*)(void))RowOrder_add, METH_FASTCALL,
     "add(key, seq, row): insert the item ((key, seq) must not be in the order)."},
    {"remove", (PyCFunction)(void (*)(void))RowOrder_remove, METH_FASTCALL,
     "remove(key, seq): take the item out; KeyError if it is not in the order."},
    {"position", (PyCFunction)(void (*)(void))RowOrder_position, METH_FASTCALL,
     "position(key, seq): how many items sort before (key, seq)."},
    {"row_at", (PyCFunction)RowOrder_row_at, METH_O, "row_at(i): the row of the i-th item."},
    {"first", (PyCFunction)RowOrder_first, METH_NOARGS, "(key, seq, row) of the first item."},
    {"last", (PyCFunction)RowOrder_last, METH_NOARGS, "(key, seq, row) of the last item."},
    {"rows", (PyCFunction)RowOrder_rows, METH_NOARGS, "The rows, from the first."},
    {"rows_reversed", (PyCFunction)RowOrder_rows_reversed, METH_NOARGS,
     "(key, row) of every item, from the last."},
    {"rows_between", (PyCFunction)(void (*)(void))RowOrder_rows_between, METH_FASTCALL,
     "rows_between(lo, hi): the rows whose key is in [lo, hi], in order."},
    {"clear", (PyCFunction)RowOrder_clear, METH_NOARGS, "Remove every item."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods RowOrder_as_sequence = {
    .sq_length = (lenfunc)RowOrder_len,
};

static PyTypeObject RowOrderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hybridkv._roworder.RowOrder",
    .tp_basicsize = sizeof(RowOrder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RowOrder(load=256): (key, seq, row) items sorted by (key, seq), in chunks of "
              "at most 2 * load; iterating gives the items from the first.",
    .tp_new = RowOrder_new,
    .tp_dealloc = (destructor)RowOrder_dealloc,
    .tp_iter = (getiterfunc)RowOrder_iter,
    .tp_methods = RowOrder_methods,
    .tp_as_sequence = &RowOrder_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_roworder", "Rows sorted by a float key and a sequence number.", -1,
    NULL,
};

PyMODINIT_FUNC PyInit__roworder(void) {
    if (PyType_Ready(&RowOrderType) < 0 || PyType_Ready(&RowOrderIterType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&RowOrderType);
    if (PyModule_AddObject(m, "RowOrder", (PyObject *)&RowOrderType) < 0) {
        Py_DECREF(&RowOrderType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
