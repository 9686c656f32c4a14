/*
 * mlpair._batch_items: a BatchPredictRequest's items read straight from its wire bytes
 * (read_items), and a BatchPredictResponse's fresh decisions written from their columns
 * (write_rows, see its docstring below: about 6 us of a row's CPU spent building a
 * PredictResponse field by field in Python becomes well under 1 us), and each item's canonical
 * request text for its idempotency fingerprint (canonical_texts), and a batch's attribute values
 * column by column with the records that hold other attributes (columns), and the decisions'
 * columns as the PostgreSQL ledger's packed text parameters (pack_column).
 *
 * Reading the parsed message from Python (mlpair.prediction.converters.predict_input) looks up
 * each attribute in the map, asks its oneof which kind is set and reads that field: three calls
 * into the protobuf runtime per attribute, about 10 us of a BatchPredict row's CPU for 13
 * attributes. This reads the same fields from the serialised request in one pass, with the
 * protobuf wire format's rules (https://protobuf.dev/programming-guides/encoding/), and gives
 * the same Python values:
 *
 *   BatchPredictRequest.requests = 1 (repeated PredictRequest)
 *   PredictRequest: request_id = 1, entity_id = 2, model_name = 4 (strings), explain = 5 (bool),
 *                   attributes = 3 (map<string, AttributeValue>: entries, key = 1, value = 2)
 *   AttributeValue.kind oneof: number_value = 1 (double), string_value = 2 (string),
 *                              bool_value = 3 (bool)
 *
 * An attribute's value is the float, str or bool of the oneof member set last, or None when none
 * is set. As a protobuf parser does: a scalar field given twice keeps the last; a map key seen
 * again replaces the earlier entry; an entry's value given twice is merged (the later member
 * wins); a missing key or string is "". Anything else makes it return None, and the caller reads
 * the parsed message instead: truncated bytes, a string that is not UTF-8, and any field it does
 * not know (another number, or a known number with another wire type), where a parser's rules
 * are subtler (a map entry holding an unknown field is kept out of the map). The service never
 * lets such fields through anyway (mlpair/wire.py refuses unknown fields before the handler). Little-endian hosts only (doubles are
 * copied as they lie on the wire); elsewhere the module does not build and the caller reads the
 * parsed message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mlpair._batch_items reads doubles in the wire's byte order: little-endian hosts only"
#endif

typedef struct {
    const char *p;
    const char *end;
} Span;

/* One remembered string per position in an item: items of a batch mostly repeat the same keys and
 * categories in the same order, so the same str object is reused (its hash computed once). */
#define REMEMBERED 64
typedef struct {
    const char *bytes;
    Py_ssize_t size;
    PyObject *text; /* a reference of its own, released by forget() */
} Remembered;

static int read_varint(Span *s, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 64 && s->p < s->end; shift += 7) {
        unsigned char byte = (unsigned char)*s->p++;
        value |= (uint64_t)(byte & 0x7f) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 1;
        }
    }
    return 0;
}

static int read_delimited(Span *s, Span *inner) {
    uint64_t size;
    if (!read_varint(s, &size) || size > (uint64_t)(s->end - s->p)) return 0;
    inner->p = s->p;
    inner->end = s->p + size;
    s->p += size;
    return 1;
}

/* The next field's tag: its number and wire type; 0 when the bytes end inside it. */
static int read_tag(Span *s, uint64_t *field, int *wire_type) {
    uint64_t tag;
    if (!read_varint(s, &tag)) return 0;
    *field = tag >> 3;
    *wire_type = (int)(tag & 7);
    return 1;
}

/* An AttributeValue being read: the member set last (0 none, 1 number, 2 string, 3 bool). */
typedef struct {
    int kind;
    double number;
    Span text;
    int flag;
} Value;

static int read_value(Span s, Value *v) {
    while (s.p < s.end) {
        uint64_t field;
        int wire_type;
        if (!read_tag(&s, &field, &wire_type)) return 0;
        if (field == 1 && wire_type == 1) {
            if (s.end - s.p < 8) return 0;
            memcpy(&v->number, s.p, 8);
            s.p += 8;
            v->kind = 1;
        } else if (field == 2 && wire_type == 2) {
            if (!read_delimited(&s, &v->text)) return 0;
            v->kind = 2;
        } else if (field == 3 && wire_type == 0) {
            uint64_t flag;
            if (!read_varint(&s, &flag)) return 0;
            v->flag = flag != 0;
            v->kind = 3;
        } else {
            return 0; /* a field this reader does not know: left to the parser */
        }
    }
    return 1;
}

/* A new reference to the str of ``text``, reusing ``memo``'s when the bytes are the same; NULL
 * with an exception set when the bytes are not UTF-8 or memory runs out. */
static PyObject *text_of(Span text, Remembered *memo) {
    Py_ssize_t size = text.end - text.p;
    if (memo != NULL && memo->text != NULL && memo->size == size && memcmp(memo->bytes, text.p, size) == 0) {
        Py_INCREF(memo->text);
        return memo->text;
    }
    PyObject *decoded = PyUnicode_DecodeUTF8(text.p, size, NULL);
    if (decoded != NULL && memo != NULL) {
        Py_XSETREF(memo->text, Py_NewRef(decoded));
        memo->bytes = text.p;
        memo->size = size;
    }
    return decoded;
}

static void forget(Remembered *memo) {
    for (int i = 0; i < REMEMBERED; i++) Py_CLEAR(memo[i].text);
}

static PyObject *value_object(const Value *v, Remembered *memo) {
    switch (v->kind) {
    case 1: return PyFloat_FromDouble(v->number);
    case 2: return text_of(v->text, memo);
    case 3: return PyBool_FromLong(v->flag);
    default: Py_RETURN_NONE;
    }
}

/* Reads one map entry into ``attributes``; 0 (no exception) when the bytes are no entry, -1 with
 * an exception set, 1 when read. ``keys`` and ``texts`` remember this position's strings. */
static int read_entry(Span s, PyObject *attributes, Remembered *keys, Remembered *texts) {
    Span key = {"", ""};
    Value value = {0, 0.0, {NULL, NULL}, 0};
    while (s.p < s.end) {
        uint64_t field;
        int wire_type;
        if (!read_tag(&s, &field, &wire_type)) return 0;
        if (field == 1 && wire_type == 2) {
            if (!read_delimited(&s, &key)) return 0;
        } else if (field == 2 && wire_type == 2) {
            Span inner;
            if (!read_delimited(&s, &inner) || !read_value(inner, &value)) return 0;
        } else {
            return 0; /* a field this reader does not know: left to the parser */
        }
    }
    PyObject *name = text_of(key, keys);
    if (name == NULL) return -1;
    PyObject *object = value_object(&value, texts);
    if (object == NULL) {
        Py_DECREF(name);
        return -1;
    }
    int failed = PyDict_SetItem(attributes, name, object);
    Py_DECREF(name);
    Py_DECREF(object);
    return failed ? -1 : 1;
}

/* Fields of PredictRequest read here; a string field given twice keeps the last, as a parser does. */
enum { REQUEST_ID = 1, ENTITY_ID = 2, ATTRIBUTES = 3, MODEL_NAME = 4, EXPLAIN = 5 };

/* One PredictRequest as a new (request_id, entity_id, model_name, attributes, explain) tuple;
 * NULL with no exception set when unreadable, with one set when memory ran out. */
static PyObject *read_item(Span s, Remembered *keys, Remembered *texts, Remembered *model) {
    Span ids[3] = {{"", ""}, {"", ""}, {"", ""}}; /* request_id, entity_id, model_name */
    int explain = 0;
    PyObject *attributes = PyDict_New();
    if (attributes == NULL) return NULL;
    int position = 0;
    while (s.p < s.end) {
        uint64_t field;
        int wire_type;
        if (!read_tag(&s, &field, &wire_type)) goto unreadable;
        if (field == ATTRIBUTES && wire_type == 2) {
            Span entry;
            if (!read_delimited(&s, &entry)) goto unreadable;
            int at = position < REMEMBERED ? position : -1;
            int read = read_entry(entry, attributes, at < 0 ? NULL : &keys[at], at < 0 ? NULL : &texts[at]);
            if (read < 0) goto failed;
            if (read == 0) goto unreadable;
            position++;
        } else if ((field == REQUEST_ID || field == ENTITY_ID || field == MODEL_NAME) && wire_type == 2) {
            if (!read_delimited(&s, &ids[field == MODEL_NAME ? 2 : field - 1])) goto unreadable;
        } else if (field == EXPLAIN && wire_type == 0) {
            uint64_t flag;
            if (!read_varint(&s, &flag)) goto unreadable;
            explain = flag != 0;
        } else {
            goto unreadable; /* a field this reader does not know: left to the parser */
        }
    }
    PyObject *request_id = text_of(ids[0], NULL);
    PyObject *entity_id = request_id ? text_of(ids[1], NULL) : NULL;
    PyObject *model_name = entity_id ? text_of(ids[2], model) : NULL;
    if (model_name == NULL) {
        Py_XDECREF(request_id);
        Py_XDECREF(entity_id);
        goto failed;
    }
    PyObject *item = PyTuple_New(5);
    if (item == NULL) {
        Py_DECREF(request_id);
        Py_DECREF(entity_id);
        Py_DECREF(model_name);
        goto failed;
    }
    PyTuple_SET_ITEM(item, 0, request_id);
    PyTuple_SET_ITEM(item, 1, entity_id);
    PyTuple_SET_ITEM(item, 2, model_name);
    PyTuple_SET_ITEM(item, 3, attributes);
    PyTuple_SET_ITEM(item, 4, PyBool_FromLong(explain));
    return item;
unreadable:
    Py_DECREF(attributes);
    return NULL;
failed:
    Py_DECREF(attributes);
    if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
        PyErr_Clear(); /* not UTF-8: the protobuf parser's business, not ours */
    }
    return NULL;
}

PyDoc_STRVAR(read_items_doc,
"read_items(data, /)\n--\n\n"
"The items of a serialised BatchPredictRequest, in order: a list of (request_id, entity_id,\n"
"model_name, attributes, explain) tuples, attributes a dict of attribute name -> float, str,\n"
"bool, or None for a value with no kind set; None when the bytes cannot be read this way (the\n"
"caller then reads the parsed message).");

static PyObject *read_items(PyObject *Py_UNUSED(module), PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    Span s = {(const char *)view.buf, (const char *)view.buf + view.len};
    Remembered keys[REMEMBERED] = {{0}};
    Remembered texts[REMEMBERED] = {{0}};
    Remembered model = {0};
    PyObject *items = PyList_New(0);
    if (items == NULL) goto done;
    while (s.p < s.end) {
        uint64_t field;
        int wire_type;
        if (!read_tag(&s, &field, &wire_type)) goto unreadable;
        if (field == 1 && wire_type == 2) {
            Span item;
            if (!read_delimited(&s, &item)) goto unreadable;
            PyObject *read = read_item(item, keys, texts, &model);
            if (read == NULL) {
                if (PyErr_Occurred()) goto failed;
                goto unreadable;
            }
            int failed = PyList_Append(items, read);
            Py_DECREF(read);
            if (failed) goto failed;
        } else {
            goto unreadable; /* a field this reader does not know: left to the parser */
        }
    }
    goto done;
unreadable:
    Py_CLEAR(items);
    items = Py_NewRef(Py_None);
    goto done;
failed:
    Py_CLEAR(items);
done:
    forget(keys);
    forget(texts);
    Py_CLEAR(model.text);
    PyBuffer_Release(&view);
    return items;
}

/* ---- writing: rows of columns as protobuf messages ---------------------------------------- */

/* A growing output buffer. */
typedef struct {
    char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
} Buffer;

static int reserve(Buffer *b, Py_ssize_t more) {
    if (b->size + more <= b->capacity) return 1;
    Py_ssize_t capacity = b->capacity ? b->capacity : 256;
    while (capacity < b->size + more) capacity *= 2;
    char *data = PyMem_Realloc(b->data, capacity);
    if (data == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    b->data = data;
    b->capacity = capacity;
    return 1;
}

/* float.__repr__ of x when its shortest round-trip form has at most 15 significant digits and is
 * written without an exponent (1e-4 <= |x| < 1e15): the whole numbers and short decimals that
 * attributes mostly are, written in about 20 ns where CPython's dtoa takes 200-800 ns. Writes at
 * most 24 bytes to out; returns their count, or 0 when x is not such a value (the caller then
 * asks PyOS_double_to_string, which writes every float).
 *
 * Why the text is repr's: K is the most decimal places that keep |x| * 10^K below 10^15, and
 * M = round(|x| * 10^K) (off by at most 0.19 from the real product, so this is the nearest integer
 * when one round-trips). If M / 10^K, a correctly rounded division like strtod's reading of the
 * decimal, gives back |x|, that decimal round-trips; with at most 15 significant digits it is the
 * only one of them that does (DBL_DIG, C11 5.2.4.2.2), so M without its trailing zeros is repr's
 * digits and K less those zeros its decimal places. repr writes such values positionally,
 * "0.0001" to "999999999999999.0", with ".0" after a whole number. tests/prediction/
 * test_batch_items.py compares it with repr on whole numbers, short decimals, random doubles
 * and the edges of the range. */
static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,  1e8,  1e9,
                               1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18};

static int short_float_repr(double x, char *out) {
    double a = x < 0 ? -x : x;
    if (!(a >= 1e-4 && a < 1e15)) return 0; /* also NaN and the infinities */
    int k = 18;
    while (k > 0 && a * POW10[k] >= 1e15) k--;
    double m = (double)(uint64_t)(a * POW10[k] + 0.5);
    if (m >= 1e15 || m / POW10[k] != a) return 0;
    uint64_t digits = (uint64_t)m;
    while (k > 0 && digits % 10 == 0) {
        digits /= 10;
        k--;
    }
    char reversed[24];
    int n = 0;
    do {
        reversed[n++] = (char)('0' + digits % 10);
        digits /= 10;
    } while (digits);
    while (n <= k) reversed[n++] = '0'; /* a leading "0" before the point, and zeros after it */
    char *to = out;
    if (x < 0) *to++ = '-';
    for (int i = n - 1; i >= k; i--) *to++ = reversed[i];
    *to++ = '.';
    if (k == 0) *to++ = '0';
    for (int i = k - 1; i >= 0; i--) *to++ = reversed[i];
    return (int)(to - out);
}

static int put_varint(Buffer *b, uint64_t value) {
    if (!reserve(b, 10)) return 0;
    do {
        unsigned char byte = value & 0x7f;
        value >>= 7;
        b->data[b->size++] = (char)(byte | (value ? 0x80 : 0));
    } while (value);
    return 1;
}

static int put_bytes(Buffer *b, const char *bytes, Py_ssize_t size) {
    if (!reserve(b, size)) return 0;
    memcpy(b->data + b->size, bytes, size);
    b->size += size;
    return 1;
}

static int put_text(Buffer *b, uint64_t field, PyObject *text) {
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (utf8 == NULL) return 0;
    return put_varint(b, field << 3 | 2) && put_varint(b, (uint64_t)size) && put_bytes(b, utf8, size);
}

/* Column kinds (see write_rows' docstring). */
enum { STRING = 0, DOUBLE = 1, BOOL = 2, INT = 3, STRINGS = 4, TIMESTAMP = 5 };

/* Field ``field`` of kind ``kind`` with ``value``, left out when it holds its default (proto3's
 * implicit presence: "", 0, false, an empty list) or is None (unset, as a message constructor
 * takes it); 0 with an exception set on failure. */
static int put_field(Buffer *b, uint64_t field, int kind, PyObject *value) {
    if (value == Py_None) return 1;
    switch (kind) {
    case STRING:
        if (!PyUnicode_Check(value)) break;
        return PyUnicode_GET_LENGTH(value) == 0 || put_text(b, field, value);
    case DOUBLE: {
        double number = PyFloat_AsDouble(value);
        if (number == -1.0 && PyErr_Occurred()) return 0;
        uint64_t bits;
        memcpy(&bits, &number, 8);
        if (bits == 0) return 1;
        return put_varint(b, field << 3 | 1) && put_bytes(b, (const char *)&number, 8);
    }
    case BOOL: {
        int flag = PyObject_IsTrue(value);
        if (flag < 0) return 0;
        return !flag || (put_varint(b, field << 3) && put_varint(b, 1));
    }
    case INT: {
        long long number = PyLong_AsLongLong(value);
        if (number == -1 && PyErr_Occurred()) return 0;
        return number == 0 || (put_varint(b, field << 3) && put_varint(b, (uint64_t)number));
    }
    case STRINGS: {
        if (PyUnicode_Check(value)) break; /* a str is a sequence too, but of characters */
        PyObject *items = PySequence_Fast(value, "a repeated string column holds sequences of str");
        if (items == NULL) return 0;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
        int ok = 1;
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(items, i);
            ok = PyUnicode_Check(item) ? put_text(b, field, item) : (PyErr_SetString(PyExc_TypeError, "not a str"), 0);
        }
        Py_DECREF(items);
        return ok;
    }
    case TIMESTAMP: { /* (seconds, nanos) as google.protobuf.Timestamp */
        long long seconds, nanos;
        if (!PyArg_ParseTuple(value, "LL", &seconds, &nanos)) return 0;
        Buffer inner = {NULL, 0, 0};
        int ok = (seconds == 0 || (put_varint(&inner, 1 << 3) && put_varint(&inner, (uint64_t)seconds))) &&
                 (nanos == 0 || (put_varint(&inner, 2 << 3) && put_varint(&inner, (uint64_t)nanos))) &&
                 put_varint(b, field << 3 | 2) && put_varint(b, (uint64_t)inner.size) &&
                 put_bytes(b, inner.data ? inner.data : "", inner.size);
        PyMem_Free(inner.data);
        return ok;
    }
    default:
        PyErr_SetString(PyExc_ValueError, "unknown column kind");
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "a string column holds str");
    return 0;
}

static int varint_size(uint64_t value) {
    int n = 1;
    while (value >= 0x80) {
        value >>= 7;
        n++;
    }
    return n;
}

PyDoc_STRVAR(write_rows_doc,
"write_rows(columns, count, wrap, /)\n--\n\n"
"Rows 0..count-1 of ``columns`` as serialised protobuf messages: a list of ``count`` bytes.\n\n"
"``columns`` is a sequence of (field number, kind, values) with ``values`` a list of at least\n"
"``count`` values; kinds: 0 string, 1 double, 2 bool, 3 int (int32/int64/enum), 4 repeated\n"
"string (a sequence of str per row), 5 google.protobuf.Timestamp given as (seconds, nanos).\n"
"Fields are written in the order given, each left out when it holds its default or is None, as\n"
"proto3 serialises. Each message is then wrapped, innermost last, in the length-delimited\n"
"fields ``wrap`` names: wrap=(1, 1) writes each row as field 1 of a message that is itself\n"
"field 1, so the rows joined are the bytes of a message whose repeated field 1 holds them.\n"
"Raises TypeError or ValueError for a value of the wrong type.");

static PyObject *write_rows(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *columns, *wrap;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "OnO", &columns, &count, &wrap)) return NULL;
    PyObject *spec = PySequence_Fast(columns, "columns must be a sequence");
    if (spec == NULL) return NULL;
    PyObject *wrapping = PySequence_Fast(wrap, "wrap must be a sequence");
    if (wrapping == NULL) {
        Py_DECREF(spec);
        return NULL;
    }
    Py_ssize_t n_columns = PySequence_Fast_GET_SIZE(spec), n_wrap = PySequence_Fast_GET_SIZE(wrapping);
    uint64_t fields[64], wraps[8];
    int kinds[64];
    PyObject *values[64];
    PyObject *out = NULL;
    Buffer row = {NULL, 0, 0};
    if (n_columns > 64 || n_wrap > 8) {
        PyErr_SetString(PyExc_ValueError, "at most 64 columns and 8 wrapping fields");
        goto done;
    }
    for (Py_ssize_t c = 0; c < n_columns; c++) {
        PyObject *column = PySequence_Fast_GET_ITEM(spec, c);
        unsigned long long field;
        if (!PyArg_ParseTuple(column, "KiO", &field, &kinds[c], &values[c])) goto done;
        if (!PyList_Check(values[c]) || PyList_GET_SIZE(values[c]) < count) {
            PyErr_SetString(PyExc_ValueError, "each column's values are a list of at least count values");
            goto done;
        }
        fields[c] = field;
    }
    for (Py_ssize_t w = 0; w < n_wrap; w++) {
        unsigned long long field = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(wrapping, w));
        if (PyErr_Occurred()) goto done;
        wraps[w] = field;
    }
    out = PyList_New(count);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        row.size = 0;
        for (Py_ssize_t c = 0; c < n_columns; c++) {
            if (!put_field(&row, fields[c], kinds[c], PyList_GET_ITEM(values[c], i))) goto failed;
        }
        /* the wrapping fields' tags and lengths, outermost first */
        uint64_t lengths[8];
        uint64_t inner = (uint64_t)row.size;
        Py_ssize_t total = row.size;
        for (Py_ssize_t w = n_wrap - 1; w >= 0; w--) {
            lengths[w] = inner;
            inner += varint_size(wraps[w] << 3 | 2) + varint_size(inner);
        }
        total = (Py_ssize_t)inner;
        PyObject *bytes = PyBytes_FromStringAndSize(NULL, total);
        if (bytes == NULL) goto failed;
        Buffer head = {NULL, 0, 0};
        int ok = 1;
        for (Py_ssize_t w = 0; ok && w < n_wrap; w++) {
            ok = put_varint(&head, wraps[w] << 3 | 2) && put_varint(&head, lengths[w]);
        }
        if (!ok) {
            PyMem_Free(head.data);
            Py_DECREF(bytes);
            goto failed;
        }
        char *to = PyBytes_AS_STRING(bytes);
        if (head.size) memcpy(to, head.data, head.size);
        if (row.size) memcpy(to + head.size, row.data, row.size);
        PyMem_Free(head.data);
        PyList_SET_ITEM(out, i, bytes);
    }
    goto done;
failed:
    Py_CLEAR(out);
done:
    PyMem_Free(row.data);
    Py_DECREF(spec);
    Py_DECREF(wrapping);
    return out;
}

/* ---- the idempotency fingerprint's canonical JSON, row by row ------------------------------- */

/* ``text`` as a JSON string the way Python's json encoder writes it with ensure_ascii=False:
 * quotes, backslashes and C0 controls escaped (\" \\ \b \f \n \r \t, else \u00xx), the rest as
 * UTF-8. 0 with an exception set when ``text`` has no UTF-8 form (lone surrogates). */
static int put_json_string(Buffer *b, PyObject *text) {
    Py_ssize_t size;
    const char *utf8 = PyUnicode_AsUTF8AndSize(text, &size);
    if (utf8 == NULL || !reserve(b, 2 + 6 * size)) return 0;
    char *to = b->data + b->size;
    *to++ = '"';
    for (Py_ssize_t i = 0; i < size; i++) {
        unsigned char c = (unsigned char)utf8[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *to++ = (char)c;
            continue;
        }
        *to++ = '\\';
        switch (c) {
        case '"': *to++ = '"'; break;
        case '\\': *to++ = '\\'; break;
        case '\b': *to++ = 'b'; break;
        case '\f': *to++ = 'f'; break;
        case '\n': *to++ = 'n'; break;
        case '\r': *to++ = 'r'; break;
        case '\t': *to++ = 't'; break;
        default: {
            static const char hex[] = "0123456789abcdef";
            *to++ = 'u';
            *to++ = '0';
            *to++ = '0';
            *to++ = hex[c >> 4];
            *to++ = hex[c & 15];
        }
        }
    }
    *to++ = '"';
    b->size = to - b->data;
    return 1;
}

/* One attribute value's JSON after its ``["name",`` head: 1 written, 0 missing (left out), -1
 * not this way (another type), -2 with an exception set. */
static int put_json_value(Buffer *b, PyObject *value) {
    if (value == Py_None) return 0;
    if (PyFloat_CheckExact(value)) {
        double x = PyFloat_AS_DOUBLE(value);
        if (x != x) return 0; /* NaN: missing */
        if (x - x != 0.0) return put_bytes(b, x > 0 ? "Infinity" : "-Infinity", x > 0 ? 8 : 9) ? 1 : -2;
        char shortcut[24];
        int size = short_float_repr(x, shortcut);
        if (size) return put_bytes(b, shortcut, size) ? 1 : -2;
        char *repr = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL); /* float.__repr__ */
        if (repr == NULL) return -2;
        int ok = put_bytes(b, repr, (Py_ssize_t)strlen(repr));
        PyMem_Free(repr);
        return ok ? 1 : -2;
    }
    if (PyBool_Check(value)) return put_bytes(b, value == Py_True ? "true" : "false", value == Py_True ? 4 : 5) ? 1 : -2;
    if (PyUnicode_CheckExact(value)) {
        if (PyUnicode_GET_LENGTH(value) == 0) return 0; /* "": missing */
        return put_json_string(b, value) ? 1 : -2;
    }
    return -1;
}

PyDoc_STRVAR(canonical_texts_doc,
"canonical_texts(head, entity_ids, name_heads, columns, /)\n--\n\n"
"Each row's canonical request text for mlpair.prediction.idempotency.request_fingerprint, as\n"
"UTF-8 bytes: ``[`` head ``,`` the entity id as JSON ``,[`` each present attribute's\n"
"name_heads[k] (``[\"name\",``) value ``]``, comma-separated ``]]``. ``head`` is the model\n"
"name as JSON (bytes); ``columns[k]`` holds attribute k's value for every row, the attributes\n"
"sorted by name. Values as json.JSONEncoder(separators=(',', ':'), ensure_ascii=False) writes\n"
"them; None, \"\" and NaN are missing and left out. A row holding a value of another type (an\n"
"int, say) or a string with no UTF-8 form is None: the caller fingerprints it itself.");

static PyObject *canonical_texts(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *head, *entity_ids, *name_heads, *columns;
    if (!PyArg_ParseTuple(args, "SO!O!O!", &head, &PyList_Type, &entity_ids, &PyList_Type, &name_heads, &PyList_Type,
                          &columns))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(entity_ids), k_max = PyList_GET_SIZE(columns);
    if (PyList_GET_SIZE(name_heads) != k_max) {
        PyErr_SetString(PyExc_ValueError, "one name head per column");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < k_max; k++) {
        PyObject *column = PyList_GET_ITEM(columns, k);
        if (!PyList_Check(column) || PyList_GET_SIZE(column) != n || !PyBytes_Check(PyList_GET_ITEM(name_heads, k))) {
            PyErr_SetString(PyExc_ValueError, "each column a list with one value per entity id; name heads bytes");
            return NULL;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    Buffer b = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        b.size = 0;
        /* state: 1 so far so good, -1 this row is not written here (None), -2 an exception is set */
        PyObject *entity = PyList_GET_ITEM(entity_ids, i);
        int state = put_bytes(&b, "[", 1) && put_bytes(&b, PyBytes_AS_STRING(head), PyBytes_GET_SIZE(head)) &&
                            put_bytes(&b, ",", 1)
                        ? 1
                        : -2;
        if (state == 1) state = !PyUnicode_CheckExact(entity) ? -1 : put_json_string(&b, entity) ? 1 : -2;
        if (state == 1) state = put_bytes(&b, ",[", 2) ? 1 : -2;
        int first = 1;
        for (Py_ssize_t k = 0; state == 1 && k < k_max; k++) {
            PyObject *name_head = PyList_GET_ITEM(name_heads, k);
            Py_ssize_t mark = b.size;
            if (!(first || put_bytes(&b, ",", 1)) || !put_bytes(&b, PyBytes_AS_STRING(name_head), PyBytes_GET_SIZE(name_head))) {
                state = -2;
                break;
            }
            int written = put_json_value(&b, PyList_GET_ITEM(PyList_GET_ITEM(columns, k), i));
            if (written == 1) {
                state = put_bytes(&b, "]", 1) ? 1 : -2;
                first = 0;
            } else if (written == 0) {
                b.size = mark; /* missing: the fragment is left out */
            } else {
                state = written;
            }
        }
        if (state == 1) state = put_bytes(&b, "]]", 2) ? 1 : -2;
        if (state == -2 && PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
            PyErr_Clear(); /* no UTF-8 form: the caller's own encoder raises as it always has */
            state = -1;
        }
        if (state == -2) {
            Py_DECREF(out);
            PyMem_Free(b.data);
            return NULL;
        }
        PyObject *text = state == 1 ? PyBytes_FromStringAndSize(b.data, b.size) : Py_NewRef(Py_None);
        if (text == NULL) {
            Py_DECREF(out);
            PyMem_Free(b.data);
            return NULL;
        }
        PyList_SET_ITEM(out, i, text);
    }
    PyMem_Free(b.data);
    return out;
}

PyDoc_STRVAR(columns_doc,
"columns(records, names) -> tuple[list[list], list[int]] | None\n\n"
"The records' values column by column: ``[[r.get(name) for r in records] for name in names]``\n"
"(None where a record lacks the name), for a list of dicts, and the positions of the records\n"
"holding a key that is not among ``names`` (distinct): ``[i for i, r in enumerate(records) if\n"
"not r.keys() <= set(names)]``. None when a record is not a dict, and the caller reads them\n"
"itself. As a comprehension, the values cost about 35 ns each and the key-set test about 0.25 us\n"
"a row; here a record's keys are counted while its values are read.");

static PyObject *columns(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *records, *names;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &records, &PyList_Type, &names)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records), k_max = PyList_GET_SIZE(names);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyDict_CheckExact(PyList_GET_ITEM(records, i))) Py_RETURN_NONE;
    PyObject *out = PyList_New(k_max), *others = PyList_New(0);
    Py_ssize_t *found = PyMem_Calloc(n ? n : 1, sizeof(Py_ssize_t)); /* each record's keys among names */
    if (out == NULL || others == NULL || found == NULL) goto fail;
    for (Py_ssize_t k = 0; k < k_max; k++) {
        PyObject *name = PyList_GET_ITEM(names, k), *column = PyList_New(n);
        if (column == NULL) goto fail;
        PyList_SET_ITEM(out, k, column);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *value = PyDict_GetItemWithError(PyList_GET_ITEM(records, i), name); /* borrowed */
            if (value == NULL && PyErr_Occurred()) goto fail; /* an unhashable name */
            found[i] += value != NULL;
            PyList_SET_ITEM(column, i, Py_NewRef(value == NULL ? Py_None : value));
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyDict_GET_SIZE(PyList_GET_ITEM(records, i)) == found[i]) continue;
        PyObject *position = PyLong_FromSsize_t(i);
        int failed = position == NULL || PyList_Append(others, position) < 0;
        Py_XDECREF(position);
        if (failed) goto fail;
    }
    PyMem_Free(found);
    return Py_BuildValue("(NN)", out, others);
fail:
    Py_XDECREF(out);
    Py_XDECREF(others);
    PyMem_Free(found);
    return NULL;
}

PyDoc_STRVAR(pack_column_doc,
"pack_column(values, order, kind) -> str | None\n\n"
"One packed column of the ledger's bulk insert (mlpair/prediction/crm/packed.py): the values at\n"
"``order`` (a list of positions), each as text and each preceded by the unit separator (\\x1f),\n"
"as ``packed.pack`` writes them. ``kind`` says how a value becomes text: 't' as it is (a str),\n"
"'f' as ``repr(float(v))`` with None as empty (float8), 'i' as ``str(v)`` (int4). None when a\n"
"text holds the separator, or when ``order`` is empty, as ``packed.pack`` refuses both (the\n"
"caller sends arrays instead). In Python the positions' values\n"
"are taken, converted and joined in three passes: about 1.2 us of a row's CPU for the ledger's\n"
"15 columns.\n\n"
"Raises: TypeError for a 't' value that is not a str; what float(v) raises for an 'f' value;\n"
"IndexError for a position outside ``values``.");

static PyObject *pack_column(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *values, *order;
    int kind;
    if (!PyArg_ParseTuple(args, "O!O!C", &PyList_Type, &values, &PyList_Type, &order, &kind)) return NULL;
    if (kind != 't' && kind != 'f' && kind != 'i') {
        PyErr_SetString(PyExc_ValueError, "kind is 't', 'f' or 'i'");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(order), size = PyList_GET_SIZE(values);
    PyObject *sep = PyUnicode_FromOrdinal(0x1f), *empty = PyUnicode_New(0, 0), *texts = PyList_New(n + 1);
    if (sep == NULL || empty == NULL || texts == NULL) goto fail;
    PyList_SET_ITEM(texts, 0, Py_NewRef(empty)); /* the leading separator: "" joined before the first */
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(order, j));
        if (i == -1 && PyErr_Occurred()) goto fail;
        if (i < 0 || i >= size) {
            PyErr_SetString(PyExc_IndexError, "a position outside the column");
            goto fail;
        }
        PyObject *value = PyList_GET_ITEM(values, i), *text;
        if (kind == 't') {
            if (!PyUnicode_Check(value)) {
                PyErr_SetString(PyExc_TypeError, "a text column holds a value that is not a str");
                goto fail;
            }
            text = Py_NewRef(value);
        } else if (kind == 'f') {
            if (value == Py_None) {
                text = Py_NewRef(empty);
            } else {
                PyObject *number = PyNumber_Float(value); /* float(v), exactly as Python would */
                if (number == NULL) goto fail;
                double x = PyFloat_AS_DOUBLE(number);
                Py_DECREF(number);
                char shortcut[24];
                int size = short_float_repr(x, shortcut);
                if (size) {
                    text = PyUnicode_FromStringAndSize(shortcut, size);
                } else {
                    char *digits = PyOS_double_to_string(x, 'r', 0, Py_DTSF_ADD_DOT_0, NULL); /* float.__repr__ */
                    if (digits == NULL) goto fail;
                    text = PyUnicode_FromString(digits);
                    PyMem_Free(digits);
                }
            }
        } else {
            text = PyObject_Str(value);
        }
        if (text == NULL) goto fail;
        PyList_SET_ITEM(texts, j + 1, text);
    }
    /* as packed.pack: the separator, then the values joined by it; no value at all is refused
     * as it refuses it (its text, the separator alone, is also that of one empty text) */
    PyObject *packed = n ? PyUnicode_Join(sep, texts) : Py_NewRef(Py_None);
    if (packed != NULL && packed != Py_None && kind == 't') {
        Py_ssize_t seps = PyUnicode_Count(packed, sep, 0, PY_SSIZE_T_MAX);
        if (seps < 0) Py_CLEAR(packed);
        else if (seps != n) Py_SETREF(packed, Py_NewRef(Py_None)); /* a value holds the separator */
    }
    Py_DECREF(sep);
    Py_DECREF(empty);
    Py_DECREF(texts);
    return packed;
fail:
    Py_XDECREF(sep);
    Py_XDECREF(empty);
    Py_XDECREF(texts);
    return NULL;
}

static PyMethodDef methods[] = {
    {"read_items", read_items, METH_O, read_items_doc},
    {"write_rows", write_rows, METH_VARARGS, write_rows_doc},
    {"canonical_texts", canonical_texts, METH_VARARGS, canonical_texts_doc},
    {"columns", columns, METH_VARARGS, columns_doc},
    {"pack_column", pack_column, METH_VARARGS, pack_column_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mlpair._batch_items",
    "A BatchPredictRequest's items read from its wire bytes, and rows of columns written as protobuf messages (see the C source's header).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__batch_items(void) { return PyModule_Create(&module); }
