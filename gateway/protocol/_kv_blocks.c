/* gateway.protocol._kv_blocks: `chain` and `walk` of gateway/protocol/kv_blocks.py in C.
 *
 * Why: the router names a request's KV blocks for every request. In Python a block costs
 * a slice, a tuple, two hashes and a dict lookup (about 1 us: 500 us for an 8,000-token
 * prompt the fleet holds). Here a token costs one hash round and a block one dict lookup.
 *
 * The names are the Python functions' to the bit: a block's name is
 * hash((parent, tuple(block))), CPython's tuple hash (xxHash rounds over the items'
 * hashes), so a gateway built without a compiler (the Python functions) and one built
 * with it name every block alike. tests/test_kv_blocks_native.py checks them side by
 * side on random and edge inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if SIZEOF_PY_HASH_T != 8
#error "the names are CPython's 64-bit tuple hashes"
#endif

#define XXPRIME_1 ((uint64_t)11400714785074694791ULL)
#define XXPRIME_2 ((uint64_t)14029467366897019727ULL)
#define XXPRIME_5 ((uint64_t)2870177450012600261ULL)
#define XXROTATE(x) (((x) << 31) | ((x) >> 33))
#define MODULUS (((uint64_t)1 << 61) - 1) /* CPython's _PyHASH_MODULUS on 64 bits */

/* The tokens, read without copying: a bytes object's bytes, else a list or tuple's
 * items (PySequence_Fast makes one of any other sequence). */
typedef struct {
    PyObject *owner; /* a reference held while reading */
    const unsigned char *bytes;
    PyObject **items;
    Py_ssize_t length;
} Tokens;

static int
tokens_open(PyObject *source, Tokens *t)
{
    t->bytes = NULL;
    t->items = NULL;
    if (PyBytes_Check(source)) {
        Py_INCREF(source);
        t->owner = source;
        t->bytes = (const unsigned char *)PyBytes_AS_STRING(source);
        t->length = PyBytes_GET_SIZE(source);
        return 0;
    }
    t->owner = PySequence_Fast(source, "tokens must be a sequence of ints");
    if (t->owner == NULL) {
        return -1;
    }
    t->items = PySequence_Fast_ITEMS(t->owner);
    t->length = PySequence_Fast_GET_SIZE(t->owner);
    return 0;
}

/* hash(int(value)) for a name (a hash itself): its absolute value modulo 2**61 - 1,
 * signed, with -1 (the C API's error value) made -2, as CPython's long_hash. */
static uint64_t
int_hash(int64_t value)
{
    uint64_t magnitude = value < 0 ? (uint64_t)0 - (uint64_t)value : (uint64_t)value;
    int64_t hash = (int64_t)(magnitude % MODULUS);
    if (value < 0) {
        hash = -hash;
    }
    return (uint64_t)(hash == -1 ? -2 : hash);
}

static inline uint64_t
xx_round(uint64_t acc, uint64_t lane)
{
    acc += lane * XXPRIME_2;
    acc = XXROTATE(acc);
    return acc * XXPRIME_1;
}

static inline uint64_t
xx_finish(uint64_t acc, Py_ssize_t length)
{
    acc += (uint64_t)length ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (uint64_t)-1 ? 1546275796 : acc;
}

/* hash(item) for a token that is a small int: itself (-1 made -2), without a call.
 * 0 when the item is not one. */
static inline int
small_int_hash(PyObject *item, Py_hash_t *lane)
{
    if (!PyLong_CheckExact(item)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        return 0;
    }
    Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)item);
    *lane = value == -1 ? -2 : value;
#else
    Py_ssize_t digits = Py_SIZE(item);
    if (digits < -1 || digits > 1) {
        return 0;
    }
    Py_hash_t value = digits == 0 ? 0 : (Py_hash_t)((PyLongObject *)item)->ob_digit[0];
    *lane = digits >= 0 ? value : (value == 1 ? -2 : -value);
#endif
    return 1;
}

/* hash(item) for any other token: a call that may run Python code (a __hash__, a
 * __del__) which may change a list of tokens under us. The item is held while it runs,
 * the list must keep its length, and its items are read again after. -1 with an
 * exception set on error. */
static Py_hash_t
other_hash(Tokens *t, Py_ssize_t index)
{
    PyObject *item = Py_NewRef(t->items[index]);
    Py_hash_t lane = PyObject_Hash(item);
    Py_DECREF(item);
    if (lane != -1 && PySequence_Fast_GET_SIZE(t->owner) != t->length) {
        PyErr_SetString(PyExc_RuntimeError, "the tokens changed size while they were hashed");
        return -1;
    }
    t->items = PySequence_Fast_ITEMS(t->owner);
    return lane;
}

#define LANES 4 /* blocks hashed side by side: their rounds do not wait on each other */

/* The tuple hashes of the `count` (1 to LANES) blocks of `size` tokens from block
 * `first`: hash(tuple(block)). The rounds of one block form a chain of dependent
 * multiplies, so LANES blocks go through the loop together. -1 with an exception set
 * when a token has no hash. */
static int
blocks_hash(Tokens *t, Py_ssize_t first, Py_ssize_t count, Py_ssize_t size,
            uint64_t hashes[LANES])
{
    Py_ssize_t start[LANES];
    uint64_t acc[LANES];
    for (int k = 0; k < LANES; k++) {
        start[k] = (first + (k < count ? k : 0)) * size; /* spare lanes redo the first */
        acc[k] = XXPRIME_5;
    }
    if (t->bytes != NULL) {
        const unsigned char *b = t->bytes;
        for (Py_ssize_t i = 0; i < size; i++) {
            for (int k = 0; k < LANES; k++) {
                acc[k] = xx_round(acc[k], b[start[k] + i]); /* hash(n) is n */
            }
        }
    }
    else {
        for (Py_ssize_t i = 0; i < size; i++) {
            for (int k = 0; k < LANES; k++) {
                Py_hash_t lane;
                if (!small_int_hash(t->items[start[k] + i], &lane)) {
                    lane = other_hash(t, start[k] + i);
                    if (lane == -1) {
                        return -1;
                    }
                }
                acc[k] = xx_round(acc[k], (uint64_t)lane);
            }
        }
    }
    for (int k = 0; k < LANES; k++) {
        hashes[k] = xx_finish(acc[k], size);
    }
    return 0;
}

/* The name of a block after the block whose name hashes to `parent_hash`, from the
 * block's tuple hash: hash((parent, tuple(block))). */
static inline int64_t
block_name(uint64_t parent_hash, uint64_t block_hash)
{
    uint64_t outer = xx_round(XXPRIME_5, parent_hash);
    return (int64_t)xx_finish(xx_round(outer, block_hash), 2);
}

/* holders[key] (borrowed), or NULL (an exception set if any), `hash` being hash(key). */
static inline PyObject *
lookup(PyObject *holders, PyObject *key, uint64_t hash)
{
#if PY_VERSION_HEX < 0x030D0000
    return _PyDict_GetItem_KnownHash(holders, key, (Py_hash_t)hash);
#else
    (void)hash;
    return PyDict_GetItemWithError(holders, key);
#endif
}

static int
parse_common(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t least, const char *fname,
             Py_ssize_t *size)
{
    if (nargs < least || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd or 3 arguments (%zd given)", fname, least,
                     nargs);
        return -1;
    }
    *size = PyLong_AsSsize_t(args[1]);
    if (*size == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*size <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(chain_doc,
             "chain(tokens, block_size, parent=0)\n--\n\n"
             "The gateway's names of the full blocks of `tokens`, in order.");

static PyObject *
kv_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t size;
    if (parse_common(args, nargs, 2, "chain", &size) < 0) {
        return NULL;
    }
    int overflow = 0;
    long long first = nargs == 3 ? PyLong_AsLongLongAndOverflow(args[2], &overflow) : 0;
    if (first == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow) { /* the names are hashes, so within 64 bits; any parent the index keeps */
        PyErr_SetString(PyExc_OverflowError, "parent is not a 64-bit block name");
        return NULL;
    }
    Tokens t;
    if (tokens_open(args[0], &t) < 0) {
        return NULL;
    }
    Py_ssize_t blocks = t.length / size;
    PyObject *names = PyList_New(blocks);
    int64_t parent = first;
    uint64_t hashes[LANES];
    for (Py_ssize_t b = 0; names != NULL && b < blocks; b++) {
        Py_ssize_t k = b % LANES;
        PyObject *name = NULL;
        if (k == 0 && blocks_hash(&t, b, Py_MIN(LANES, blocks - b), size, hashes) < 0) {
            Py_CLEAR(names);
            break;
        }
        parent = block_name(int_hash(parent), hashes[k]);
        name = PyLong_FromLongLong(parent);
        if (name == NULL) {
            Py_CLEAR(names);
            break;
        }
        PyList_SET_ITEM(names, b, name);
    }
    Py_DECREF(t.owner);
    return names;
}

/* One step of `walk` where the holders change: see the Python function. Returns 1 when
 * the walk ends here, 0 when it goes on, -1 on error. */
static int
holders_change(PyObject *bits, PyObject **alive, PyObject *groups, Py_ssize_t depth)
{
    PyObject *common = PyNumber_And(bits, *alive);
    if (common == NULL) {
        return -1;
    }
    int changed = PyObject_RichCompareBool(common, *alive, Py_NE);
    int ends = 0;
    if (changed > 0) {
        if (depth > 0) {
            PyObject *kept = PyNumber_Invert(common);
            PyObject *stop = kept == NULL ? NULL : PyNumber_And(*alive, kept);
            Py_XDECREF(kept);
            PyObject *group = stop == NULL ? NULL : Py_BuildValue("(Nn)", stop, depth);
            if (group == NULL || PyList_Append(groups, group) < 0) {
                Py_XDECREF(group);
                Py_DECREF(common);
                return -1;
            }
            Py_DECREF(group);
        }
        int any = PyObject_IsTrue(common);
        int same = any > 0 ? PyObject_RichCompareBool(common, bits, Py_EQ) : 0;
        if (any < 0 || same < 0) {
            changed = -1;
        }
        else if (!any) {
            ends = 1;
        }
        else {
            Py_SETREF(*alive, Py_NewRef(same ? bits : common));
        }
    }
    Py_DECREF(common);
    return changed < 0 ? -1 : ends;
}

PyDoc_STRVAR(walk_doc,
             "walk(tokens, block_size, holders)\n--\n\n"
             "The groups of workers (bits, blocks held) along the request's chain, and its\n"
             "last name walked.");

static PyObject *
kv_walk(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t size;
    if (parse_common(args, nargs, 3, "walk", &size) < 0) {
        return NULL;
    }
    PyObject *holders = args[2];
    if (!PyDict_Check(holders)) {
        PyErr_SetString(PyExc_TypeError, "holders must be a dict");
        return NULL;
    }
    Tokens t;
    if (tokens_open(args[0], &t) < 0) {
        return NULL;
    }
    PyObject *groups = PyList_New(0);
    PyObject *alive = PyLong_FromLong(-1); /* every worker, before the first block */
    PyObject *zero = PyLong_FromLong(0);
    PyObject *last = Py_NewRef(Py_None);
    Py_ssize_t blocks = t.length / size;
    int64_t name = 0; /* ROOT */
    int ends = 0;
    uint64_t hashes[LANES];
    if (groups == NULL || alive == NULL || zero == NULL) {
        goto fail;
    }
    Py_ssize_t batch = 0, hashed = 0; /* hashes[] holds blocks batch .. batch + hashed - 1 */
    uint64_t name_hash = 0;            /* hash(ROOT) */
    for (Py_ssize_t depth = 0; depth < blocks && !ends; depth++) {
        if (depth == batch + hashed) { /* the first block alone: a new prompt stops there */
            batch = depth;
            hashed = depth == 0 ? 1 : Py_MIN(LANES, blocks - depth);
            if (blocks_hash(&t, batch, hashed, size, hashes) < 0) {
                goto fail;
            }
        }
        name = block_name(name_hash, hashes[depth - batch]);
        name_hash = int_hash(name);
        PyObject *key = PyLong_FromLongLong(name);
        if (key == NULL) {
            goto fail;
        }
        Py_SETREF(last, key);
        PyObject *bits = lookup(holders, key, name_hash);
        if (bits == NULL) {
            if (PyErr_Occurred()) {
                goto fail;
            }
            bits = zero;
        }
        if (bits != alive) {
            Py_INCREF(bits); /* borrowed from a dict that only ints key, but held anyway */
            ends = holders_change(bits, &alive, groups, depth);
            Py_DECREF(bits);
            if (ends < 0) {
                goto fail;
            }
        }
    }
    if (!ends && blocks > 0) {
        PyObject *group = Py_BuildValue("(On)", alive, blocks);
        if (group == NULL || PyList_Append(groups, group) < 0) {
            Py_XDECREF(group);
            goto fail;
        }
        Py_DECREF(group);
    }
    Py_DECREF(t.owner);
    Py_DECREF(alive);
    Py_DECREF(zero);
    return Py_BuildValue("(NN)", groups, last);
fail:
    Py_DECREF(t.owner);
    Py_XDECREF(groups);
    Py_XDECREF(alive);
    Py_XDECREF(zero);
    Py_XDECREF(last);
    return NULL;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))kv_chain, METH_FASTCALL, chain_doc},
    {"walk", (PyCFunction)(void (*)(void))kv_walk, METH_FASTCALL, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "gateway.protocol._kv_blocks",
    "chain and walk of gateway.protocol.kv_blocks, in C.",
    0,
    methods,
    NULL, /* slots */
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__kv_blocks(void)
{
    return PyModuleDef_Init(&module);
}
