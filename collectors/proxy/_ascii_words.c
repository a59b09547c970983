/* The pre-tokens of ASCII text under Qwen2's and Llama 3's split regex, and their ids from a word cache, in C.
 *
 * `collectors.proxy.ascii_bpe` cuts a text into pre-tokens with the tokenizer's own regex (Python's `re`) and
 * looks each one up in a dict of the ids it was tokenized to. Per pre-token that costs ~250 ns in `re.findall`
 * (matching, and making each word's string) and ~150 ns in the Python loop over them, which makes tokenizing
 * what a call adds the proxy's largest cost that grows with the call. No library does the cut alone: the
 * `tokenizers` pipeline costs 3x the Python path (it tracks offsets and builds an `Encoding`), and a regex
 * engine with lighter bindings still makes a string and a Python object per match. Here the scan is the
 * regex's own leftmost-first alternation, written out for ASCII text, and the lookups and the ids' list are made
 * in the same pass.
 *
 * The regex (Oniguruma's, as Qwen2 and Llama 3 tokenizers write it; among ASCII characters \p{L} is [A-Za-z],
 * \p{N} is [0-9], \s is [\t\n\v\f\r ]):
 *
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d) | [^\r\n\p{L}\p{N}]?\p{L}+ | \p{N}{1,D} | ?[^\s\p{L}\p{N}]+[\r\n]*
 *     | \s*[\r\n]+ | \s+(?!\S) | \s+
 *
 * with D = 1 (Qwen2) or 3 (Llama 3). `next_word` tries the alternatives in that order at each position and
 * returns where the first one that matches ends, as the backtracking engines do. Every ASCII character starts
 * some alternative, so this regex leaves no gap. The Python module checks the scan against `re.findall` on
 * a corpus of every ASCII character in context before it takes it, and its tests compare them on random text.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static inline int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}
static inline int is_letter(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
static inline int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
static inline int is_newline(unsigned char c) { return c == '\n' || c == '\r'; }
static inline int is_other(unsigned char c) { return !is_space(c) && !is_letter(c) && !is_digit(c); }
static inline unsigned char lower(unsigned char c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

/* Where the pre-token that starts at s[i] ends (i < n). */
static Py_ssize_t next_word(const unsigned char *s, Py_ssize_t n, Py_ssize_t i, int digits) {
    unsigned char c = s[i];
    Py_ssize_t j;
    if (c == '\'' && i + 1 < n) { /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
        unsigned char d = lower(s[i + 1]);
        if (d == 's' || d == 't' || d == 'm' || d == 'd')
            return i + 2;
        if (i + 2 < n) {
            unsigned char e = lower(s[i + 2]);
            if ((d == 'r' && e == 'e') || (d == 'v' && e == 'e') || (d == 'l' && e == 'l'))
                return i + 3;
        }
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+ : the optional character cannot be a letter, so a letter starts the run itself */
    if (is_letter(c) || (!is_newline(c) && !is_digit(c) && i + 1 < n && is_letter(s[i + 1]))) {
        for (j = i + 1; j < n && is_letter(s[j]); j++)
            ;
        return j;
    }
    if (is_digit(c)) { /* \p{N}{1,D} */
        for (j = i + 1; j < n && j - i < digits && is_digit(s[j]); j++)
            ;
        return j;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* */
    j = (c == ' ' && i + 1 < n && is_other(s[i + 1])) ? i + 1 : i;
    if (is_other(s[j])) {
        while (j < n && is_other(s[j]))
            j++;
        while (j < n && is_newline(s[j]))
            j++;
        return j;
    }
    /* c is a space: the run of spaces is [i, j) */
    for (j = i + 1; j < n && is_space(s[j]); j++)
        ;
    for (Py_ssize_t q = j - 1; q >= i; q--) /* \s*[\r\n]+ : up to the run's last newline */
        if (is_newline(s[q]))
            return q + 1;
    if (j == n || j - 1 == i) /* \s+(?!\S) at the end; a lone space before a word is \s+ */
        return j;
    return j - 1; /* \s+(?!\S) : the last space goes with the word after it */
}

static int digits_of(int digits) { return digits == 3 ? 3 : 1; }

/* split(text, digits) -> the pre-tokens, as re.findall gives them (for the tests and the corpus check) */
static PyObject *split(PyObject *self, PyObject *args) {
    PyObject *text, *out, *word;
    int digits;
    if (!PyArg_ParseTuple(args, "Ui", &text, &digits))
        return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "split takes ASCII text only");
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), i = 0, j;
    if (!(out = PyList_New(0)))
        return NULL;
    for (; i < n; i = j) {
        j = next_word(s, n, i, digits_of(digits));
        if (!(word = PyUnicode_Substring(text, i, j)) || PyList_Append(out, word) < 0) {
            Py_XDECREF(word);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(word);
    }
    return out;
}

/* The words last found in the word cache, in front of it: a hit costs a short hash of the word's bytes and a
 * memcmp, where a dict lookup makes the word's string first (an allocation, a copy and SipHash: most of the
 * ~25 ns a pre-token that the pass cost). Direct-mapped by an FNV-1a hash of the bytes; a slot holds the word and
 * its ids (strong references). It serves one cache dict at a time (a strong reference to it, so that its
 * address names it for as long as the table holds its words) and starts over for another. A word's ids never
 * change for a tokenizer, so entries stay right when the dict is cleared (`ascii_bpe` starts it over when
 * full): the cache dict may only gain entries or be cleared, never see a word map to other ids. */
#define FRONT_SLOTS 8192 /* a power of two: ~5,000 words in use at once at most, 200 kB of pointers and hashes */
typedef struct {
    uint64_t hash;
    PyObject *word; /* str, ASCII */
    PyObject *ids;  /* list of int */
} front_slot;
static front_slot front[FRONT_SLOTS];
static PyObject *front_cache = NULL; /* the dict the table serves */

static inline uint64_t fnv1a(const unsigned char *s, Py_ssize_t n) {
    uint64_t h = 14695981039346656037ULL;
    for (Py_ssize_t k = 0; k < n; k++)
        h = (h ^ s[k]) * 1099511628211ULL;
    return h;
}

static void front_clear(void) {
    for (Py_ssize_t k = 0; k < FRONT_SLOTS; k++) {
        Py_CLEAR(front[k].word);
        Py_CLEAR(front[k].ids);
    }
    Py_CLEAR(front_cache);
}

/* front_clear(): empty the front table (the tests' way to compare with the dict alone) */
static PyObject *clear_front(PyObject *self, PyObject *unused) {
    front_clear();
    Py_RETURN_NONE;
}

/* encode(text, cache, digits) -> (ids, []) when `cache` (pre-token -> list of ids) holds every pre-token of
 * `text`, else (None, the pre-tokens it lacks, in order, repeats included) */
static PyObject *encode(PyObject *self, PyObject *args) {
    PyObject *text, *cache, *missing = NULL, *ids = NULL, *result;
    int digits;
    if (!PyArg_ParseTuple(args, "UO!i", &text, &PyDict_Type, &cache, &digits))
        return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "encode takes ASCII text only");
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), i = 0, j, size = 0, cap = 256;
    PyObject **out = PyMem_Malloc(cap * sizeof(PyObject *)); /* the ids, each a new reference */
    if (!out)
        return PyErr_NoMemory();
    if (!(missing = PyList_New(0)))
        goto fail;
    if (front_cache != cache) { /* another tokenizer's cache: its words are not these */
        front_clear();
        Py_INCREF(cache);
        front_cache = cache;
    }
    digits = digits_of(digits);
    for (; i < n; i = j) {
        j = next_word(s, n, i, digits);
        uint64_t h = fnv1a(s + i, j - i);
        front_slot *slot = &front[h & (FRONT_SLOTS - 1)];
        PyObject *got; /* borrowed */
        if (slot->word != NULL && slot->hash == h && PyUnicode_GET_LENGTH(slot->word) == j - i &&
            memcmp(PyUnicode_1BYTE_DATA(slot->word), s + i, j - i) == 0) {
            got = slot->ids;
        } else {
            PyObject *key = PyUnicode_New(j - i, 127);
            if (!key)
                goto fail;
            memcpy(PyUnicode_1BYTE_DATA(key), s + i, j - i);
            got = PyDict_GetItemWithError(cache, key);
            if (got == NULL) {
                int bad = PyErr_Occurred() != NULL || PyList_Append(missing, key) < 0;
                Py_DECREF(key);
                if (bad)
                    goto fail;
                continue;
            }
            if (!PyList_Check(got)) {
                Py_DECREF(key);
                PyErr_SetString(PyExc_TypeError, "the word cache must map each pre-token to a list of ids");
                goto fail;
            }
            Py_INCREF(got);
            Py_XSETREF(slot->ids, got); /* the slot holds the key (a new reference) and the ids from here on */
            Py_XSETREF(slot->word, key);
            slot->hash = h;
        }
        if (PyList_GET_SIZE(missing))
            continue; /* no ids are returned: only the rest of what is missing matters */
        Py_ssize_t m = PyList_GET_SIZE(got);
        if (size + m > cap) {
            while (size + m > cap)
                cap *= 2;
            PyObject **grown = PyMem_Realloc(out, cap * sizeof(PyObject *));
            if (!grown) {
                PyErr_NoMemory();
                goto fail;
            }
            out = grown;
        }
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *id = PyList_GET_ITEM(got, k);
            Py_INCREF(id);
            out[size++] = id;
        }
    }
    if (PyList_GET_SIZE(missing)) {
        ids = Py_None;
        Py_INCREF(ids);
    } else {
        if (!(ids = PyList_New(size)))
            goto fail;
        for (Py_ssize_t k = 0; k < size; k++)
            PyList_SET_ITEM(ids, k, out[k]); /* steals the reference */
        size = 0;
    }
    PyMem_Free(out);
    result = PyTuple_Pack(2, ids, missing);
    Py_DECREF(ids);
    Py_DECREF(missing);
    return result;
fail:
    for (Py_ssize_t k = 0; k < size; k++)
        Py_DECREF(out[k]);
    PyMem_Free(out);
    Py_XDECREF(missing);
    return NULL;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(text, digits): the pre-tokens of ASCII text (digits: 1 Qwen2, 3 Llama 3)"},
    {"encode", encode, METH_VARARGS,
     "encode(text, cache, digits): (ids, []) from the word cache, or (None, the pre-tokens it lacks)"},
    {"clear_front", clear_front, METH_NOARGS, "clear_front(): empty the table of recent words in front of the cache"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ascii_words",
                                    "Pre-tokens of ASCII text and their cached ids (see the file's comment).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__ascii_words(void) { return PyModule_Create(&module); }
