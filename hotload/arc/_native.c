/*
 * hotload.arc._native: the optional C kernel of the arc_v2 decoder.
 *
 * Decoding a sparse chunk in numpy takes some thirty array operations, each on a few thousand
 * elements; on real models (a hundred chunks per snapshot, half of them biases and norms) their
 * fixed costs, not the bytes, set the decode speed. This kernel does the same work in one pass
 * per changed element and without the GIL. hotload.arc.chunk keeps the numpy path as the
 * reference and uses this one when it is built; tests check both against each other and against
 * the independent decoder of the specification (tests/support/arc_spec_decoder.py).
 *
 * The format is docs/arc_v2.md, section "sparse runs": k changed positions coded as gaps
 * (remainder planes of the low `shift` bits, then quotient planes), and k zigzagged wrapping
 * differences coded as value planes, each plane a stream of packed 1/2/4/8-bit symbols.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <unistd.h>
#include <string.h>

#define MOD_ADLER 65521u
#define MAX_PLANES 24 /* 7 remainder + 8 quotient + 8 value planes, with room */

typedef struct {
    const uint8_t *data; /* at least ceil(count / (8 / bits)) bytes (checked on entry) */
    int bits;
} plane_t;

/* Changes are decoded in blocks: each plane's symbols are unpacked for a block in a tight loop
 * (one per plane and symbol width, which the compiler vectorizes), then the block is applied. */
#define BLOCK 256

/* OR symbols [start, start + n) of a plane, shifted left by `shift` bits, into out[0 .. n). */
static void unpack_into(const plane_t *p, Py_ssize_t start, int n, int shift, uint64_t *out) {
    const uint8_t *d = p->data;
    switch (p->bits) {
    case 8:
        for (int t = 0; t < n; t++)
            out[t] |= (uint64_t)d[start + t] << shift;
        break;
    case 4:
        for (int t = 0; t < n; t++) {
            Py_ssize_t i = start + t;
            out[t] |= (uint64_t)((d[i >> 1] >> ((i & 1) * 4)) & 0x0f) << shift;
        }
        break;
    case 2:
        for (int t = 0; t < n; t++) {
            Py_ssize_t i = start + t;
            out[t] |= (uint64_t)((d[i >> 2] >> ((i & 3) * 2)) & 0x03) << shift;
        }
        break;
    default:
        for (int t = 0; t < n; t++) {
            Py_ssize_t i = start + t;
            out[t] |= (uint64_t)((d[i >> 3] >> (i & 7)) & 0x01) << shift;
        }
    }
}

/* Little-endian join of planes[first .. first+count) for symbols [start, start + n). */
static void join_block(const plane_t *planes, int first, int count, Py_ssize_t start, int n,
                       uint64_t *out) {
    memset(out, 0, (size_t)n * sizeof *out);
    for (int j = 0; j < count; j++)
        unpack_into(&planes[first + j], start, n, 8 * j, out);
}

enum { OK = 0, BAD_REMAINDER, BAD_GAP, PAST_END, WRITE_FAILED };

/* A chunk holds at most 2**24 elements of at most 8 bytes (MAX_CHUNK_ELEMENTS in codec.py). */
#define MAX_CHUNK_BYTES ((Py_ssize_t)1 << 27)
/* Consecutive changed elements written through to the file go out in one pwrite. */
#define PENDING_BYTES 512
/* How far ahead of a change the parent's bytes are copied: few memcpy calls, still in cache. */
#define COPY_AHEAD 4096

typedef struct {
    const plane_t *planes;
    int rp, qp, vp;        /* remainder, quotient and value planes, in that order */
    int shift;
    Py_ssize_t k, m;       /* changed elements, elements in the chunk */
    const uint8_t *src;    /* the parent's elements */
    uint8_t *dst;          /* the rebuilt chunk (may be src: in place), or NULL: see fd */
    int fd;                /* with dst NULL: write changed elements to fd at offset + position */
    int64_t offset;
    int64_t da, db;        /* what the run adds to adler32's sums A and B (not reduced) */
    Py_ssize_t bad;        /* the change at fault when the status is not OK */
    int error;             /* errno of a failed write */
} run_t;

static int write_all(int fd, const uint8_t *buf, size_t len, int64_t at) {
    while (len) {
        ssize_t done = pwrite(fd, buf, len, (off_t)at);
        if (done < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        buf += done, len -= (size_t)done, at += done;
    }
    return 0;
}

/* The loop over a run's changes; `width` is a constant in each caller, so loads, stores and
 * the per-byte checksum loop compile to a few instructions (this function is inlined).
 * Copying into a separate dst, the parent's bytes are copied a few KiB at a time just ahead of
 * the changes: one sequential pass, where patching a copied chunk waits on a cache miss per
 * change. */
static inline __attribute__((always_inline)) int apply_run(run_t *run, const int width) {
    const uint64_t vmask = width == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * width)) - 1);
    const uint64_t qmax = (uint64_t)(run->m - 1) >> run->shift;
    const int64_t length = (int64_t)run->m * width;
    const plane_t *planes = run->planes;
    const int copying = run->dst && run->dst != run->src;
    uint64_t rem[BLOCK], quo[BLOCK], val[BLOCK];
    uint8_t pending[PENDING_BYTES];
    int64_t pending_at = 0;
    size_t pending_len = 0;
    int64_t da = 0, db = 0;
    int64_t copied = 0; /* bytes of dst filled so far, when copying */
    Py_ssize_t pos = -1;
    for (Py_ssize_t start = 0; start < run->k; start += BLOCK) {
        int n = run->k - start < BLOCK ? (int)(run->k - start) : BLOCK;
        join_block(planes, 0, run->rp, start, n, rem);
        join_block(planes, run->rp, run->qp, start, n, quo);
        join_block(planes, run->rp + run->qp, run->vp, start, n, val);
        for (int t = 0; t < n; t++) {
            uint64_t r = rem[t], q = quo[t];
            if (r >> run->shift)
                return run->bad = start + t, BAD_REMAINDER;
            if (q > qmax)
                return run->bad = start + t, BAD_GAP;
            uint64_t gap = (q << run->shift) | r;
            if (gap >= (uint64_t)run->m)
                return run->bad = start + t, BAD_GAP;
            pos += (Py_ssize_t)gap + 1;
            if (pos >= run->m)
                return run->bad = start + t, PAST_END;
            uint64_t zz = val[t];
            uint64_t diff = ((zz >> 1) ^ (~(zz & 1) + 1)) & vmask;
            int64_t byte = (int64_t)pos * width;
            uint64_t old = 0;
            memcpy(&old, run->src + byte, (size_t)width); /* little-endian (chunk.py checks) */
            uint64_t new = (old + diff) & vmask;
            if (run->dst) {
                if (copying && byte + width > copied) {
                    int64_t upto = copied + COPY_AHEAD > byte + width ? copied + COPY_AHEAD
                                                                      : byte + width;
                    upto = upto < length ? upto : length;
                    memcpy(run->dst + copied, run->src + copied, (size_t)(upto - copied));
                    copied = upto;
                }
                memcpy(run->dst + byte, &new, (size_t)width);
            } else {
                byte += run->offset;
                if (pending_len && (byte != pending_at + (int64_t)pending_len ||
                                    pending_len + (size_t)width > PENDING_BYTES)) {
                    if ((run->error = write_all(run->fd, pending, pending_len, pending_at)))
                        return WRITE_FAILED;
                    pending_len = 0;
                }
                if (!pending_len)
                    pending_at = byte;
                memcpy(pending + pending_len, &new, (size_t)width);
                pending_len += (size_t)width;
            }
            /* adler32 is linear in the bytes: byte j of this element, at offset pos*width + j,
             * moves A by its difference d and B by (length - offset) * d. */
            int64_t weight = length - (int64_t)pos * width;
            for (int j = 0; j < width; j++) {
                int64_t d =
                    (int64_t)((new >> (8 * j)) & 0xff) - (int64_t)((old >> (8 * j)) & 0xff);
                da += d;
                db += (weight - j) * d;
            }
        }
        /* One element moves B by under 2**27 * 2**8 * 8 = 2**38 (MAX_CHUNK_BYTES): a block
         * cannot overflow int64, and reducing after each keeps the sums small. */
        da %= (int64_t)MOD_ADLER, db %= (int64_t)MOD_ADLER;
    }
    if (copying && length > copied)
        memcpy(run->dst + copied, run->src + copied, (size_t)(length - copied));
    if (pending_len && (run->error = write_all(run->fd, pending, pending_len, pending_at)))
        return WRITE_FAILED;
    run->da = da, run->db = db;
    return OK;
}

/* A run's planes from the sequences `planes_obj` (buffers) and `bits_obj` (symbol widths):
 * `nplanes` of them, each holding at least `k` symbols; their buffers are acquired into views
 * (*nviews counts them: the caller releases them, also on error). Returns -1 with an exception. */
static int get_planes(PyObject *planes_obj, PyObject *bits_obj, Py_ssize_t nplanes, Py_ssize_t k,
                      plane_t *planes, Py_buffer *views, int *nviews) {
    int status = -1;
    PyObject *planes_seq = PySequence_Fast(planes_obj, "planes must be a sequence");
    PyObject *bits_seq = planes_seq ? PySequence_Fast(bits_obj, "bits must be a sequence") : NULL;
    if (!bits_seq)
        goto done;
    if (nplanes > MAX_PLANES || PySequence_Fast_GET_SIZE(planes_seq) != nplanes ||
        PySequence_Fast_GET_SIZE(bits_seq) != nplanes) {
        PyErr_SetString(PyExc_ValueError, "planes and bits must match the run's plane count");
        goto done;
    }
    for (Py_ssize_t p = 0; p < nplanes; p++) {
        long bits = PyLong_AsLong(PySequence_Fast_GET_ITEM(bits_seq, p));
        if (PyErr_Occurred())
            goto done;
        if (!(bits == 1 || bits == 2 || bits == 4 || bits == 8)) {
            PyErr_SetString(PyExc_ValueError, "symbol bits must be 1, 2, 4 or 8");
            goto done;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(planes_seq, p), &views[*nviews],
                               PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        (*nviews)++;
        Py_ssize_t per = 8 / bits;
        if (views[p].len < (k + per - 1) / per) {
            PyErr_SetString(PyExc_ValueError, "a plane is shorter than its symbols");
            goto done;
        }
        planes[p] = (plane_t){(const uint8_t *)views[p].buf, (int)bits};
    }
    status = 0;
done:
    Py_XDECREF(planes_seq);
    Py_XDECREF(bits_seq);
    return status;
}

PyDoc_STRVAR(sparse_patch_doc,
"sparse_patch(old, out, width, planes, bits, count, shift, quotient_planes, value_planes,\n"
"             offset=0, /)\n--\n\n"
"Rebuild a chunk from the parent's elements `old` and a sparse run. Returns (da, db): what\n"
"the changes add to adler32's two sums, modulo 65521 (see checksum.adler32_shift).\n\n"
"`out` is a writable buffer as large as `old` (or `old` itself, patched in place) that\n"
"receives the whole chunk, or a file descriptor (an int) that receives only the changed\n"
"elements, each at `offset` plus its byte position (the caller wrote the parent's bytes\n"
"there). Raises ValueError naming what is wrong with a corrupted run, OSError when a write\n"
"fails; the target may then be partly written, so callers discard it.");

static PyObject *sparse_patch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 9 && nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "sparse_patch takes 9 or 10 positional arguments");
        return NULL;
    }
    long fd = -1;
    long long offset = 0;
    int to_file = PyLong_Check(args[1]);
    if (to_file) {
        fd = PyLong_AsLong(args[1]);
        offset = nargs == 10 ? PyLong_AsLongLong(args[9]) : 0;
        if (PyErr_Occurred())
            return NULL;
        if (fd < 0 || fd > INT_MAX || offset < 0) {
            PyErr_SetString(PyExc_ValueError, "a file target needs fd >= 0 and offset >= 0");
            return NULL;
        }
    }
    Py_buffer src, dst;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int have_dst = 0;
    PyObject *result = NULL;
    Py_buffer views[MAX_PLANES];
    int nviews = 0;
    if (!to_file) {
        if (PyObject_GetBuffer(args[1], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        have_dst = 1;
        if (dst.len != src.len) {
            PyErr_SetString(PyExc_ValueError, "out must be as large as old");
            goto done;
        }
    }
    long width = PyLong_AsLong(args[2]);
    Py_ssize_t k = PyLong_AsSsize_t(args[5]);
    long shift = PyLong_AsLong(args[6]);
    long qp = PyLong_AsLong(args[7]);
    long vp = PyLong_AsLong(args[8]);
    if (PyErr_Occurred())
        goto done;
    if (!(width == 1 || width == 2 || width == 4 || width == 8) || src.len % width ||
        src.len > MAX_CHUNK_BYTES) {
        PyErr_SetString(PyExc_ValueError,
                        "old must hold whole elements of 1, 2, 4 or 8 bytes, at most 2**27 bytes");
        goto done;
    }
    Py_ssize_t m = src.len / width;
    long rp = (shift + 7) / 8;
    if (k < 1 || k > m || shift < 0 || shift > 56 || qp < 1 || qp > 8 || vp < 1 || vp > width) {
        PyErr_SetString(PyExc_ValueError, "run fields out of range");
        goto done;
    }
    plane_t planes[MAX_PLANES];
    if (get_planes(args[3], args[4], rp + qp + vp, k, planes, views, &nviews) < 0)
        goto done;
    run_t run = {planes,
                 (int)rp,
                 (int)qp,
                 (int)vp,
                 (int)shift,
                 k,
                 m,
                 (const uint8_t *)src.buf,
                 have_dst ? (uint8_t *)dst.buf : NULL,
                 (int)fd,
                 (int64_t)offset,
                 0,
                 0,
                 0,
                 0};
    int status;
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1: status = apply_run(&run, 1); break;
    case 2: status = apply_run(&run, 2); break;
    case 4: status = apply_run(&run, 4); break;
    default: status = apply_run(&run, 8); break;
    }
    Py_END_ALLOW_THREADS
    switch (status) {
    case BAD_REMAINDER:
        PyErr_Format(PyExc_ValueError, "a gap remainder does not fit its %ld bits (change %zd)",
                     shift, run.bad);
        break;
    case BAD_GAP:
        PyErr_Format(PyExc_ValueError,
                     "a gap between changed positions exceeds the chunk (change %zd)", run.bad);
        break;
    case PAST_END:
        PyErr_Format(PyExc_ValueError,
                     "a changed position lies past the chunk's %zd elements (change %zd)", m,
                     run.bad);
        break;
    case WRITE_FAILED:
        errno = run.error;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    default:;
        int64_t a = run.da % (int64_t)MOD_ADLER, b = run.db % (int64_t)MOD_ADLER;
        result = Py_BuildValue("(ll)", (long)(a < 0 ? a + MOD_ADLER : a),
                               (long)(b < 0 ? b + MOD_ADLER : b));
    }
done:
    for (int v = 0; v < nviews; v++)
        PyBuffer_Release(&views[v]);
    if (have_dst)
        PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* The positions and differences of a run, without its parent: position `first` + p of each
 * change into positions[0 .. k), its unzigzagged wrapping difference into values (k elements of
 * `width` bytes). The same checks as apply_run, in the same order. */
static int changes_run(const plane_t *planes, int rp, int qp, int vp, int shift, Py_ssize_t k,
                       Py_ssize_t m, int64_t first, int64_t *positions, uint8_t *values,
                       const int width, Py_ssize_t *bad) {
    const uint64_t vmask = width == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (8 * width)) - 1);
    const uint64_t qmax = (uint64_t)(m - 1) >> shift;
    uint64_t rem[BLOCK], quo[BLOCK], val[BLOCK];
    Py_ssize_t pos = -1;
    for (Py_ssize_t start = 0; start < k; start += BLOCK) {
        int n = k - start < BLOCK ? (int)(k - start) : BLOCK;
        join_block(planes, 0, rp, start, n, rem);
        join_block(planes, rp, qp, start, n, quo);
        join_block(planes, rp + qp, vp, start, n, val);
        for (int t = 0; t < n; t++) {
            uint64_t r = rem[t], q = quo[t];
            if (r >> shift)
                return *bad = start + t, BAD_REMAINDER;
            if (q > qmax)
                return *bad = start + t, BAD_GAP;
            uint64_t gap = (q << shift) | r;
            if (gap >= (uint64_t)m)
                return *bad = start + t, BAD_GAP;
            pos += (Py_ssize_t)gap + 1;
            if (pos >= m)
                return *bad = start + t, PAST_END;
            uint64_t zz = val[t];
            uint64_t diff = ((zz >> 1) ^ (~(zz & 1) + 1)) & vmask;
            positions[start + t] = first + (int64_t)pos;
            memcpy(values + (start + t) * width, &diff, (size_t)width); /* little-endian */
        }
    }
    return OK;
}

PyDoc_STRVAR(sparse_changes_doc,
"sparse_changes(positions, values, m, first, width, planes, bits, count, shift,\n"
"               quotient_planes, value_planes, /)\n--\n\n"
"Decode a sparse run of a chunk of `m` elements without its parent: `positions` (a writable\n"
"int64 buffer of at least `count` elements) receives `first` plus each changed position,\n"
"`values` (writable, at least `count` elements of `width` bytes) each wrapping difference\n"
"new - old. Raises ValueError naming what is wrong with a corrupted run.");

static PyObject *sparse_changes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "sparse_changes takes 11 positional arguments");
        return NULL;
    }
    Py_buffer pos_buf, val_buf;
    if (PyObject_GetBuffer(args[0], &pos_buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[1], &val_buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&pos_buf);
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer views[MAX_PLANES];
    int nviews = 0;
    Py_ssize_t m = PyLong_AsSsize_t(args[2]);
    long long first = PyLong_AsLongLong(args[3]);
    long width = PyLong_AsLong(args[4]);
    Py_ssize_t k = PyLong_AsSsize_t(args[7]);
    long shift = PyLong_AsLong(args[8]);
    long qp = PyLong_AsLong(args[9]);
    long vp = PyLong_AsLong(args[10]);
    if (PyErr_Occurred())
        goto done;
    if (!(width == 1 || width == 2 || width == 4 || width == 8) || m < 1 ||
        m > MAX_CHUNK_BYTES / width || first < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "a chunk holds 1 to 2**27 bytes of 1, 2, 4 or 8-byte elements");
        goto done;
    }
    long rp = (shift + 7) / 8;
    if (k < 1 || k > m || shift < 0 || shift > 56 || qp < 1 || qp > 8 || vp < 1 || vp > width) {
        PyErr_SetString(PyExc_ValueError, "run fields out of range");
        goto done;
    }
    if (pos_buf.len < k * (Py_ssize_t)sizeof(int64_t) || val_buf.len < k * width) {
        PyErr_SetString(PyExc_ValueError, "positions and values must hold count elements");
        goto done;
    }
    plane_t planes[MAX_PLANES];
    if (get_planes(args[5], args[6], rp + qp + vp, k, planes, views, &nviews) < 0)
        goto done;
    int status;
    Py_ssize_t bad = 0;
    int64_t *positions = (int64_t *)pos_buf.buf;
    uint8_t *values = (uint8_t *)val_buf.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1:
        status = changes_run(planes, rp, qp, vp, shift, k, m, first, positions, values, 1, &bad);
        break;
    case 2:
        status = changes_run(planes, rp, qp, vp, shift, k, m, first, positions, values, 2, &bad);
        break;
    case 4:
        status = changes_run(planes, rp, qp, vp, shift, k, m, first, positions, values, 4, &bad);
        break;
    default:
        status = changes_run(planes, rp, qp, vp, shift, k, m, first, positions, values, 8, &bad);
    }
    Py_END_ALLOW_THREADS
    switch (status) {
    case BAD_REMAINDER:
        PyErr_Format(PyExc_ValueError, "a gap remainder does not fit its %ld bits (change %zd)",
                     shift, bad);
        break;
    case BAD_GAP:
        PyErr_Format(PyExc_ValueError,
                     "a gap between changed positions exceeds the chunk (change %zd)", bad);
        break;
    case PAST_END:
        PyErr_Format(PyExc_ValueError,
                     "a changed position lies past the chunk's %zd elements (change %zd)", m, bad);
        break;
    default:
        Py_INCREF(Py_None);
        result = Py_None;
    }
done:
    for (int v = 0; v < nviews; v++)
        PyBuffer_Release(&views[v]);
    PyBuffer_Release(&val_buf);
    PyBuffer_Release(&pos_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"sparse_patch", (PyCFunction)(void (*)(void))sparse_patch, METH_FASTCALL, sparse_patch_doc},
    {"sparse_changes", (PyCFunction)(void (*)(void))sparse_changes, METH_FASTCALL,
     sparse_changes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The optional C kernel of the arc_v2 decoder (see hotload.arc.chunk).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
