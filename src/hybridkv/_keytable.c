/* A table from short byte strings (entry keys) to 64-bit integers, for the scheduler
 * side's largest per-key tables (core/keytable.py says why).
 *
 * Open addressing with linear probing, the key stored in its slot (32 bytes: value,
 * length, up to 23 key bytes), deletion by backward shift (no tombstones). Split into 64
 * parts by the key's hash, so that growing one part rehashes a 64th of the keys. Bulk
 * calls (`missing`, `present`, `get_many`, `pop_many`) hash a batch of keys and prefetch
 * their first slots before probing any, so the cache misses of a batch overlap.
 *
 * Everything runs with the GIL held and calls nothing that can release it or run Python
 * code between a lookup and its use: no slot pointer outlives a resize.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_MAX 23
#define EMPTY 0xFF
#define PARTS 64
#define FIRST_CAPACITY 8
#define BATCH 32

typedef struct {
    int64_t value;
    uint8_t len; /* EMPTY: a free slot */
    uint8_t key[KEY_MAX];
} Slot;

typedef struct {
    Slot *slots;
    size_t mask; /* capacity - 1, a power of two less one */
    size_t used;
} Part;

typedef struct {
    PyObject_HEAD
    Part parts[PARTS];
    Py_ssize_t size;
} KeyTable;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t hash_key(const uint8_t *key, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ULL ^ (uint64_t)n;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, key + i, 8);
        h = rotl((h ^ w) * 0xff51afd7ed558ccdULL, 31);
    }
    if (i < n) {
        uint64_t w = 0;
        memcpy(&w, key + i, n - i);
        h = rotl((h ^ w) * 0xff51afd7ed558ccdULL, 31);
    }
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline Part *part_of(KeyTable *t, uint64_t h) { return &t->parts[h >> 58]; }

static Slot *find(Part *p, uint64_t h, const uint8_t *key, size_t n) {
    size_t i = h & p->mask;
    for (;;) {
        Slot *s = &p->slots[i];
        if (s->len == EMPTY)
            return NULL;
        if (s->len == n && memcmp(s->key, key, n) == 0)
            return s;
        i = (i + 1) & p->mask;
    }
}

static Slot *new_slots(size_t capacity) {
    Slot *slots = PyMem_Malloc(capacity * sizeof(Slot));
    if (slots == NULL)
        return NULL;
    memset(slots, EMPTY, capacity * sizeof(Slot));
    return slots;
}

static int grow(Part *p) {
    size_t capacity = (p->mask + 1) * 2;
    Slot *slots = new_slots(capacity);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t j = 0; j <= p->mask; j++) {
        Slot *s = &p->slots[j];
        if (s->len == EMPTY)
            continue;
        size_t i = hash_key(s->key, s->len) & (capacity - 1);
        while (slots[i].len != EMPTY)
            i = (i + 1) & (capacity - 1);
        slots[i] = *s;
    }
    PyMem_Free(p->slots);
    p->slots = slots;
    p->mask = capacity - 1;
    return 0;
}

/* The key's bytes; 0, or -1 with an error set unless `quiet` (then 0 means "cannot be
 * here": not bytes, or too long). */
static int key_bytes(PyObject *obj, const uint8_t **key, size_t *n, int quiet) {
    if (!PyBytes_Check(obj)) {
        if (!quiet)
            PyErr_Format(PyExc_TypeError, "KeyTable keys are bytes, not %.100s",
                         Py_TYPE(obj)->tp_name);
        return -1;
    }
    *n = (size_t)PyBytes_GET_SIZE(obj);
    if (*n > KEY_MAX) {
        if (!quiet)
            PyErr_Format(PyExc_ValueError, "KeyTable keys are at most %d bytes, got %zu",
                         KEY_MAX, *n);
        return -1;
    }
    *key = (const uint8_t *)PyBytes_AS_STRING(obj);
    return 0;
}

/* The slot of `obj`, NULL if absent (no error set), or NULL with an error set for a key
 * of the wrong type (not for one too long: it is absent). */
static Slot *lookup(KeyTable *t, PyObject *obj) {
    const uint8_t *key;
    size_t n;
    if (!PyBytes_Check(obj)) {
        key_bytes(obj, &key, &n, 0);
        return NULL;
    }
    if (key_bytes(obj, &key, &n, 1) < 0)
        return NULL;
    uint64_t h = hash_key(key, n);
    return find(part_of(t, h), h, key, n);
}

static int store(KeyTable *t, PyObject *obj, int64_t value) {
    const uint8_t *key;
    size_t n;
    if (key_bytes(obj, &key, &n, 0) < 0)
        return -1;
    uint64_t h = hash_key(key, n);
    Part *p = part_of(t, h);
    Slot *s = find(p, h, key, n);
    if (s != NULL) {
        s->value = value;
        return 0;
    }
    if ((p->used + 1) * 4 > (p->mask + 1) * 3 && grow(p) < 0)
        return -1;
    size_t i = h & p->mask;
    while (p->slots[i].len != EMPTY)
        i = (i + 1) & p->mask;
    s = &p->slots[i];
    s->value = value;
    s->len = (uint8_t)n;
    memcpy(s->key, key, n);
    p->used++;
    t->size++;
    return 0;
}

/* Free slot `s` of its part, moving back the slots after it that probed past it. */
static void erase(KeyTable *t, Slot *s) {
    Part *p = part_of(t, hash_key(s->key, s->len));
    size_t i = (size_t)(s - p->slots), j = i;
    for (;;) {
        j = (j + 1) & p->mask;
        Slot *next = &p->slots[j];
        if (next->len == EMPTY)
            break;
        size_t home = hash_key(next->key, next->len) & p->mask;
        /* `next` stays if its home lies cyclically in (i, j]. */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (stays)
            continue;
        p->slots[i] = *next;
        i = j;
    }
    p->slots[i].len = EMPTY;
    p->used--;
    t->size--;
}

static int64_t as_value(PyObject *obj, int *failed) {
    long long v = PyLong_AsLongLong(obj);
    *failed = v == -1 && PyErr_Occurred();
    return (int64_t)v;
}

/* ---- the type ----------------------------------------------------------------------- */

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyTable() takes no arguments");
        return NULL;
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < PARTS; i++) {
        t->parts[i].slots = new_slots(FIRST_CAPACITY);
        if (t->parts[i].slots == NULL) {
            Py_DECREF(t);
            return PyErr_NoMemory();
        }
        t->parts[i].mask = FIRST_CAPACITY - 1;
    }
    return (PyObject *)t;
}

static void KeyTable_dealloc(KeyTable *t) {
    for (int i = 0; i < PARTS; i++)
        PyMem_Free(t->parts[i].slots);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->size; }

static int KeyTable_contains(KeyTable *t, PyObject *key) {
    Slot *s = lookup(t, key);
    if (s == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return 1;
}

static PyObject *KeyTable_getitem(KeyTable *t, PyObject *key) {
    Slot *s = lookup(t, key);
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLongLong(s->value);
}

static int KeyTable_ass(KeyTable *t, PyObject *key, PyObject *value) {
    if (value != NULL) {
        int failed;
        int64_t v = as_value(value, &failed);
        return failed ? -1 : store(t, key, v);
    }
    Slot *s = lookup(t, key);
    if (s == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    erase(t, s);
    return 0;
}

/* `get` (the default None) or `pop` (no default: KeyError) of a key. */
static PyObject *get_or_pop(KeyTable *t, PyObject *const *args, Py_ssize_t nargs, int pop) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, pop ? "pop(key[, default])" : "get(key, default=None)");
        return NULL;
    }
    Slot *s = lookup(t, args[0]);
    if (s != NULL) {
        PyObject *out = PyLong_FromLongLong(s->value);
        if (out != NULL && pop)
            erase(t, s);
        return out;
    }
    if (PyErr_Occurred())
        return NULL;
    if (nargs == 2)
        return Py_NewRef(args[1]);
    if (!pop)
        Py_RETURN_NONE;
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    return get_or_pop(t, args, nargs, 0);
}

static PyObject *KeyTable_pop(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    return get_or_pop(t, args, nargs, 1);
}

static PyObject *KeyTable_setdefault(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "setdefault(key, default)");
        return NULL;
    }
    Slot *s = lookup(t, args[0]);
    if (s != NULL)
        return PyLong_FromLongLong(s->value);
    if (PyErr_Occurred())
        return NULL;
    int failed;
    int64_t v = as_value(args[1], &failed);
    if (failed || store(t, args[0], v) < 0)
        return NULL;
    return Py_NewRef(args[1]);
}

enum { MISSING, PRESENT, GET_MANY, POP_MANY };

/* One pass over `keys` in batches: hash and prefetch a batch, then probe it. */
static PyObject *bulk(KeyTable *t, PyObject *keys, int mode, PyObject *dflt) {
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    /* Making a list can run a collection, and so Python code that changes `keys`: their
     * items are read only after it (nothing below allocates a tracked object). */
    PyObject *out = PyList_New(mode >= GET_MANY ? n : 0);
    if (out == NULL)
        goto fail;
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_SetString(PyExc_RuntimeError, "keys changed size during the lookup");
        goto fail;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t start = 0; start < n; start += BATCH) {
        Py_ssize_t end = start + BATCH < n ? start + BATCH : n;
        uint64_t hashes[BATCH];
        signed char absent[BATCH]; /* too long to be here */
        for (Py_ssize_t i = start; i < end; i++) {
            const uint8_t *key;
            size_t len;
            if (!PyBytes_Check(items[i])) {
                key_bytes(items[i], &key, &len, 0);
                goto fail;
            }
            absent[i - start] = key_bytes(items[i], &key, &len, 1) < 0;
            if (absent[i - start])
                continue;
            uint64_t h = hash_key(key, len);
            Part *p = part_of(t, h);
            hashes[i - start] = h;
            __builtin_prefetch(&p->slots[h & p->mask]);
        }
        for (Py_ssize_t i = start; i < end; i++) {
            PyObject *key = items[i];
            Slot *s = NULL;
            if (!absent[i - start]) {
                uint64_t h = hashes[i - start];
                s = find(part_of(t, h), h, (const uint8_t *)PyBytes_AS_STRING(key),
                         (size_t)PyBytes_GET_SIZE(key));
            }
            if (mode >= GET_MANY) {
                PyObject *v = s != NULL ? PyLong_FromLongLong(s->value) : Py_NewRef(dflt);
                if (v == NULL)
                    goto fail;
                PyList_SET_ITEM(out, i, v);
                /* Erasing shifts slots, not hashes: the batch's later keys probe anew. */
                if (mode == POP_MANY && s != NULL)
                    erase(t, s);
            } else if ((s == NULL) == (mode == MISSING) && PyList_Append(out, key) < 0) {
                goto fail;
            }
        }
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *KeyTable_missing(KeyTable *t, PyObject *keys) {
    return bulk(t, keys, MISSING, NULL);
}

static PyObject *KeyTable_present(KeyTable *t, PyObject *keys) {
    return bulk(t, keys, PRESENT, NULL);
}

static PyObject *KeyTable_get_many(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "get_many(keys, default)");
        return NULL;
    }
    return bulk(t, args[0], GET_MANY, args[1]);
}

static PyObject *KeyTable_pop_many(KeyTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pop_many(keys, default)");
        return NULL;
    }
    return bulk(t, args[0], POP_MANY, args[1]);
}

enum { KEYS, VALUES, ITEMS };

static PyObject *listing(KeyTable *t, int what) {
    /* The slots copied out first: making a Python object may run a collection, and so
     * Python code that changes the table (a growing part rehashes: a walk over it would
     * list some keys twice). The list then holds the table as it was when called. */
    Py_ssize_t n = t->size;
    Slot *copy = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Slot));
    if (copy == NULL)
        return PyErr_NoMemory();
    Py_ssize_t k = 0;
    for (int i = 0; i < PARTS; i++) {
        Part *p = &t->parts[i];
        for (size_t j = 0; j <= p->mask && k < n; j++) {
            if (p->slots[j].len != EMPTY)
                copy[k++] = p->slots[j];
        }
    }
    PyObject *out = PyList_New(k);
    if (out == NULL) {
        PyMem_Free(copy);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        const Slot *s = &copy[i];
        PyObject *item;
        if (what == VALUES) {
            item = PyLong_FromLongLong(s->value);
        } else if (what == KEYS) {
            item = PyBytes_FromStringAndSize((const char *)s->key, s->len);
        } else {
            item = Py_BuildValue("(y#L)", (const char *)s->key, (Py_ssize_t)s->len,
                                 (long long)s->value);
        }
        if (item == NULL) {
            PyMem_Free(copy);
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    PyMem_Free(copy);
    return out;
}

static PyObject *KeyTable_keys(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    return listing(t, KEYS);
}

static PyObject *KeyTable_values(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    return listing(t, VALUES);
}

static PyObject *KeyTable_items(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    return listing(t, ITEMS);
}

static PyObject *KeyTable_iter(KeyTable *t) {
    PyObject *keys = listing(t, KEYS);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *KeyTable_clear(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    for (int i = 0; i < PARTS; i++) {
        Part *p = &t->parts[i];
        Slot *slots = new_slots(FIRST_CAPACITY);
        if (slots == NULL)
            return PyErr_NoMemory();
        PyMem_Free(p->slots);
        p->slots = slots;
        p->mask = FIRST_CAPACITY - 1;
        p->used = 0;
    }
    t->size = 0;
    Py_RETURN_NONE;
}

static PyObject *KeyTable_sizeof(KeyTable *t, PyObject *Py_UNUSED(ignored)) {
    size_t total = sizeof(KeyTable);
    for (int i = 0; i < PARTS; i++)
        total += (t->parts[i].mask + 1) * sizeof(Slot);
    return PyLong_FromSize_t(total);
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL, "get(key, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyTable_pop, METH_FASTCALL, "pop(key[, default])"},
    {"setdefault", (PyCFunction)(void (*)(void))KeyTable_setdefault, METH_FASTCALL,
     "setdefault(key, default)"},
    {"missing", (PyCFunction)KeyTable_missing, METH_O,
     "The keys not here, in their order: one call for a lookup's hundreds."},
    {"present", (PyCFunction)KeyTable_present, METH_O, "The keys here, in their order."},
    {"get_many", (PyCFunction)(void (*)(void))KeyTable_get_many, METH_FASTCALL,
     "`get` of each key, in their order."},
    {"pop_many", (PyCFunction)(void (*)(void))KeyTable_pop_many, METH_FASTCALL,
     "`pop` of each key with a default, in their order (a key twice: the default the second time)."},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "A list of the keys."},
    {"values", (PyCFunction)KeyTable_values, METH_NOARGS, "A list of the values."},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, "A list of (key, value)."},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "Remove every key."},
    {"__sizeof__", (PyCFunction)KeyTable_sizeof, METH_NOARGS, "Bytes held."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyMappingMethods KeyTable_as_mapping = {
    .mp_length = (lenfunc)KeyTable_len,
    .mp_subscript = (binaryfunc)KeyTable_getitem,
    .mp_ass_subscript = (objobjargproc)KeyTable_ass,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "hybridkv._keytable.KeyTable",
    .tp_doc = "A table from byte strings of up to 23 bytes to 64-bit integers.",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_iter = (getiterfunc)KeyTable_iter,
    .tp_methods = KeyTable_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_keytable",
    .m_doc = "See core/keytable.py.",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__keytable(void) {
    if (PyType_Ready(&KeyTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyTableType);
    if (PyModule_AddObject(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(&KeyTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
