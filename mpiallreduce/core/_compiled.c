/* The hot paths of repeated calls, compiled: optional (mpiallreduce.core.compiled says whether it
 * was built; setup.py builds it with Open MPI's mpicc). Each does what the Python beside it does, in
 * the same order, and hands anything unusual back to that Python.
 *
 *   PreparedBase()         a prepared call bound to a persistent request, or to a plain
 *                          MPI_Allreduce of its buffers (Prepared, prepared.py):
 *                            state.sequence += 1       (the number, on the caller's thread)
 *                            MPI_Start, MPI_Test       (SPIN_TESTS times: a small one is done)
 *                            MPI_Wait                  (if not, the GIL released, as mpi4py does)
 *                            or MPI_Allreduce          (plain: the GIL released)
 *                            a mean's division         (in C for float32 and float64, else then())
 *                          anything else (a flight recorder, pending asynchronous calls, an
 *                          argument): self._call(...), the Python
 *
 *   ShortPath(x, out)      the short path of a repeated plain call of MPI's own allreduce
 *                          (Execution._short_path, executor.py), on contiguous numpy arrays:
 *                            out: None (a new array), x (in place), or a distinct array like x
 *                            number; publish the code in the shared slots and read the peers'
 *                            (SignatureSlots.agree); not all there yet: compare(sequence), Python;
 *                            or, with no slots (across nodes, ULFM), the codes alone in the
 *                            rounds below (signature_messages.codes_agree_by_messages' messages)
 *                            MPI_Allreduce (the GIL released), a mean's division (as above)
 *                          or dissemination's rounds carrying the signature, then its reduction
 *                          returns None where the Python path must take the call
 *
 *   exchange_rounds(...)   the rounds of dissemination (algorithms/dissemination.py) with the GIL
 *                          released: its messages, the codes' maxima, the blocks; a wait that
 *                          lasts goes back to the Python, which waits through the call's PeerWatch
 *
 * The slots' stores and loads are C11 atomics (release, acquire): what SignatureSlots does with
 * MPI_Win_sync between its plain stores and loads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <mpi.h>
#include <fenv.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <limits.h>
#include <sched.h>

/* a prepared run tests its request this many times before it waits with the GIL released (a
 * small allreduce is done by then: no hand-over of the GIL; a late peer costs a few us more) */
#define SPIN_TESTS 64

/* the dimensions a ShortPath binds (numpy allows 64: compiled.short_path leaves more to Python) */
#define MAX_DIMENSIONS 8

static PyObject *s_pending, *s_recorder, *s_sequence, *s_call, *s_slots, *s_library, *s_dtype, *s_nbytes, *s_spin, *s_spin_per_byte,
    *s_ahead;

/* The objects' attributes are read from their __dict__s (borrowed, no attribute lookup: a few ns
 * where getattr costs 20), which the binding passes: CommState and the worker keep them there. */

/* state.sequence += 1 (``state``: its __dict__); the new number, or -1 with an exception set */
static long long next_number(PyObject *state)
{
    PyObject *now = PyDict_GetItemWithError(state, s_sequence);
    if (now == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_AttributeError, "the communicator's state has no sequence");
        return -1;
    }
    long long number = PyLong_AsLongLong(now) + 1;
    if (number == 0 && PyErr_Occurred())
        return -1;
    PyObject *next = PyLong_FromLongLong(number);
    if (next == NULL)
        return -1;
    int failed = PyDict_SetItem(state, s_sequence, next);
    Py_DECREF(next);
    if (failed)
        return -1;
    /* as CommState.number: what a first use outside a call learnt of this number (a peer gave the
     * call up) is raised by the call of that number, once */
    PyObject *ahead = PyDict_GetItemWithError(state, s_ahead);
    if (ahead == NULL)
        return PyErr_Occurred() ? -1 : number;
    if (ahead == Py_None)
        return number;
    Py_INCREF(ahead);
    PyObject *of = PyDict_SetItem(state, s_ahead, Py_None) < 0 ? NULL : PyObject_GetAttrString(ahead, "sequence");
    long long given_up = of == NULL ? -1 : PyLong_AsLongLong(of);
    Py_XDECREF(of);
    if (of == NULL || (given_up == -1 && PyErr_Occurred())) {
        Py_DECREF(ahead);
        return -1;
    }
    if (given_up == number) {
        PyErr_SetObject((PyObject *)Py_TYPE(ahead), ahead);
        Py_DECREF(ahead);
        return -1;
    }
    Py_DECREF(ahead);
    return number;
}

/* 1 where the Python path must take the call: an asynchronous call pending (``worker``: the
 * worker's __dict__), a flight recorder (``state``'s __dict__); -1 with an exception set */
static int unusual(PyObject *worker, PyObject *state)
{
    PyObject *pending = PyDict_GetItemWithError(worker, s_pending);
    if (pending == NULL)
        return PyErr_Occurred() ? -1 : 1;
    if (pending != Py_False && !(PyLong_CheckExact(pending) && PyLong_AsLongLong(pending) == 0))
        return 1;
    PyObject *recorder = PyDict_GetItemWithError(state, s_recorder);
    if (recorder == NULL)
        return PyErr_Occurred() ? -1 : 1;
    return recorder != Py_None;
}

/* an error handed to Python's failed(error, number), which raises what it means: an MPI error
 * code (an int: failed makes the MPI.Exception), or the exception set now (then() raised) */
static PyObject *failed_with(PyObject *failed, int code, long long number)
{
    PyObject *error;
    if (code == MPI_SUCCESS) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL)
            PyException_SetTraceback(value, traceback);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        error = value;
    } else {
        error = PyLong_FromLong(code);
    }
    if (error == NULL)
        return NULL;
    PyObject *raised = PyObject_CallFunction(failed, "OL", error, number);
    Py_DECREF(error);
    if (raised != NULL) {  /* (it must raise: say so if it did not) */
        Py_DECREF(raised);
        PyErr_Format(PyExc_RuntimeError, "error %d in allreduce call #%lld", code, number);
    }
    return NULL;
}

/* A mean's division of float32 or float64 results, in C: numpy's (core.ops._division: a multiply
 * by 1/size for a power of two, else a divide by size) with the same IEEE operations, so the same
 * bits, without a ufunc call's microsecond; float errors masked, as the executor masks numpy's
 * (the flags raised here are dropped). kind: 4 (float32), 8 (float64), 0: Python's then() does it */
typedef struct {
    int kind, multiply;
    double factor;
} Division;

static void divide(const Division *d, void *values, Py_ssize_t count)
{
    fenv_t kept;
    feholdexcept(&kept);
    if (d->kind == 4) {
        float *v = values, f = (float)d->factor;
        if (d->multiply)
            for (Py_ssize_t i = 0; i < count; i++) v[i] = v[i] * f;
        else
            for (Py_ssize_t i = 0; i < count; i++) v[i] = v[i] / f;
    } else {
        double *v = values, f = d->factor;
        if (d->multiply)
            for (Py_ssize_t i = 0; i < count; i++) v[i] = v[i] * f;
        else
            for (Py_ssize_t i = 0; i < count; i++) v[i] = v[i] / f;
    }
    fesetenv(&kept);
}

/* ---- PreparedBase -------------------------------------------------------------------------- */

/* The head of a numpy array (numpy's public PyArrayObject_fields, the same layout in numpy 1 and 2):
 * what a prepared run reads to see that x still lies where its request was bound */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
} NdarrayHead;

typedef struct {
    PyObject_HEAD
    MPI_Request request;
    int bound;
    PyObject *state, *worker, *result, *then, *failed, *keep, *library, *divided, *arrays;
    Division division;
    void *values;               /* the divided array's memory (``divided`` holds it) */
    Py_ssize_t count;
    /* where the user's arrays (x, and out if another) lay, and their shapes, when the request was bound */
    int watched;
    char *data[2];
    int nd[2];
    Py_ssize_t dims[2][MAX_DIMENSIONS];
    /* a plain MPI_Allreduce in place of the persistent request (``plain``: where the plan has none) */
    int plain;
    void *send, *recv;
    int plain_count;
    MPI_Datatype datatype;
    MPI_Op op;
    MPI_Comm comm;
} PreparedBase;

/* 1 where one of the user's arrays no longer lies where the request was bound, or has another shape
 * (resized in place with refcheck=False, its shape set): the Python path raises, before MPI touches
 * that memory */
static int moved(PreparedBase *self)
{
    for (int k = 0; k < self->watched; k++) {
        NdarrayHead *a = (NdarrayHead *)PyTuple_GET_ITEM(self->arrays, k);
        if (a->data != self->data[k] || a->nd != self->nd[k])
            return 1;
        for (int i = 0; i < a->nd; i++)
            if (a->dimensions[i] != self->dims[k][i])
                return 1;
    }
    return 0;
}

static int prepared_traverse(PreparedBase *self, visitproc visit, void *arg)
{
    Py_VISIT(self->state); Py_VISIT(self->worker); Py_VISIT(self->result);
    Py_VISIT(self->then); Py_VISIT(self->failed); Py_VISIT(self->keep); Py_VISIT(self->library);
    Py_VISIT(self->divided); Py_VISIT(self->arrays);
    return 0;
}

static int prepared_clear(PreparedBase *self)
{
    self->bound = 0;
    Py_CLEAR(self->state); Py_CLEAR(self->worker); Py_CLEAR(self->result);
    Py_CLEAR(self->then); Py_CLEAR(self->failed); Py_CLEAR(self->keep); Py_CLEAR(self->library);
    Py_CLEAR(self->divided); Py_CLEAR(self->arrays);
    return 0;
}

static void prepared_dealloc(PreparedBase *self)
{
    PyObject_GC_UnTrack(self);
    prepared_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* _bind_compiled(request_handle, vars(state), vars(worker), result, then, failed, keep, library,
 *                (kind, multiply, factor), divided, arrays[, plain]):
 * runs go through C (``keep``: what owns the request, held while bound; ``library``: the state's
 * communicator, which a run checks is still there: freed, the Python path raises); a mean's
 * division of the array ``divided`` in C where kind is 4 or 8, else by then(). ``plain``, with a
 * request handle of 0: (send address, 0 for MPI_IN_PLACE; receive address; count; the handles of
 * the datatype, the op and the communicator): each run is that MPI_Allreduce */
static PyObject *prepared_bind(PreparedBase *self, PyObject *args)
{
    unsigned long long handle;
    PyObject *state, *worker, *result, *then, *failed, *keep, *library, *divided, *arrays;
    PyObject *plain = Py_None;
    Division division;
    if (!PyArg_ParseTuple(args, "KO!O!OOOOO(iid)OO!|O", &handle, &PyDict_Type, &state, &PyDict_Type,
                          &worker, &result, &then, &failed, &keep, &library, &division.kind,
                          &division.multiply, &division.factor, &divided, &PyTuple_Type, &arrays,
                          &plain))
        return NULL;
    prepared_clear(self);
    self->plain = 0;
    if (plain != Py_None) {
        unsigned long long send, recv, datatype, op, comm;
        int count;
        if (!PyArg_ParseTuple(plain, "KKiKKK", &send, &recv, &count, &datatype, &op, &comm))
            return NULL;
        self->send = send ? (void *)(uintptr_t)send : MPI_IN_PLACE;
        self->recv = (void *)(uintptr_t)recv;
        self->plain_count = count;
        self->datatype = (MPI_Datatype)(uintptr_t)datatype;
        self->op = (MPI_Op)(uintptr_t)op;
        self->comm = (MPI_Comm)(uintptr_t)comm;
        self->plain = 1;
    }
    if (PyTuple_GET_SIZE(arrays) > 2)
        Py_RETURN_NONE;  /* (not bound: the Python path checks them) */
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(arrays); k++) {
        NdarrayHead *a = (NdarrayHead *)PyTuple_GET_ITEM(arrays, k);  /* (numpy.ndarray itself: the caller checks) */
        if (a->nd > MAX_DIMENSIONS)
            Py_RETURN_NONE;
        self->data[k] = a->data;
        self->nd[k] = a->nd;
        for (int i = 0; i < a->nd; i++)
            self->dims[k][i] = a->dimensions[i];
    }
    self->watched = (int)PyTuple_GET_SIZE(arrays);
    Py_INCREF(arrays); self->arrays = arrays;
    self->division = division;
    if (division.kind) {  /* (its memory, for good: the prepared call holds the array) */
        Py_buffer view;
        if (PyObject_GetBuffer(divided, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        self->values = view.buf;
        self->count = view.len / division.kind;
        PyBuffer_Release(&view);
    }
    Py_INCREF(divided); self->divided = divided;
    self->request = (MPI_Request)(uintptr_t)handle;
    Py_INCREF(state); self->state = state;
    Py_INCREF(worker); self->worker = worker;
    Py_INCREF(result); self->result = result;
    Py_INCREF(then); self->then = then;
    Py_INCREF(failed); self->failed = failed;
    Py_INCREF(keep); self->keep = keep;
    Py_INCREF(library); self->library = library;
    self->bound = 1;
    Py_RETURN_NONE;
}

static PyObject *prepared_is_bound(PreparedBase *self, PyObject *unused)
{
    return PyBool_FromLong(self->bound);
}

static PyObject *prepared_call(PreparedBase *self, PyObject *args, PyObject *kwargs)
{
    if (!self->bound || PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0))
        goto python;
    int other = unusual(self->worker, self->state);
    if (other < 0)
        return NULL;
    if (other || PyDict_GetItemWithError(self->state, s_library) != self->library  /* (freed: Python raises) */
        || moved(self))
        goto python;
    long long number = next_number(self->state);
    if (number < 0)
        return NULL;
    int code, done = 0;
    if (self->plain) {  /* (blocking: the GIL released, as mpi4py does) */
        Py_BEGIN_ALLOW_THREADS
        code = MPI_Allreduce(self->send, self->recv, self->plain_count, self->datatype, self->op,
                             self->comm);
        Py_END_ALLOW_THREADS
    } else {
        code = MPI_Start(&self->request);
        for (int i = 0; i < SPIN_TESTS && code == MPI_SUCCESS && !done; i++)
            code = MPI_Test(&self->request, &done, MPI_STATUS_IGNORE);
        if (code == MPI_SUCCESS && !done) {
            Py_BEGIN_ALLOW_THREADS
            code = MPI_Wait(&self->request, MPI_STATUS_IGNORE);
            Py_END_ALLOW_THREADS
        }
    }
    if (code != MPI_SUCCESS)
        return failed_with(self->failed, code, number);
    if (self->division.kind)
        divide(&self->division, self->values, self->count);
    else if (self->then != Py_None) {
        PyObject *done = PyObject_CallNoArgs(self->then);
        if (done == NULL)
            return failed_with(self->failed, MPI_SUCCESS, number);  /* (the Python error then() raised) */
        Py_DECREF(done);
    }
    Py_INCREF(self->result);
    return self->result;
python:;
    PyObject *call = PyObject_GetAttr((PyObject *)self, s_call);
    if (call == NULL)
        return NULL;
    PyObject *result = PyObject_Call(call, args, kwargs);
    Py_DECREF(call);
    return result;
}

static PyMethodDef prepared_methods[] = {
    {"_bind_compiled", (PyCFunction)prepared_bind, METH_VARARGS,
     "_bind_compiled(request_handle, vars(state), vars(worker), result, then, failed, keep, library, "
     "(kind, multiply, factor), divided, arrays): runs go through C"},
    {"_compiled_bound", (PyCFunction)prepared_is_bound, METH_NOARGS, "whether runs go through C"},
    {NULL}
};

static PyTypeObject PreparedBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpiallreduce.core._compiled.PreparedBase",
    .tp_basicsize = sizeof(PreparedBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A prepared call whose runs on a persistent request are compiled (see _compiled.c).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)prepared_dealloc,
    .tp_traverse = (traverseproc)prepared_traverse,
    .tp_clear = (inquiry)prepared_clear,
    .tp_call = (ternaryfunc)prepared_call,
    .tp_methods = prepared_methods,
};

/* ---- dissemination's rounds ------------------------------------------------------------------ */

/* exchange_rounds(comm, tag, size, rank, work, capacity, x, nbytes, high, negated, number, spin,
 * spin_per_byte, tail_offset): the rounds of the dissemination algorithm (mpiallreduce/algorithms/dissemination.py,
 * which says what moves; this does what its Python does, message for message). ``work`` (an
 * address): the codes (CODES_BYTES: high, negated, the call's number, the tail's length), the
 * ``size`` blocks of ``nbytes``, then ``capacity`` bytes for a head (signature_messages.
 * SIGNATURE_MESSAGE_BYTES, what every receive on these tags posts); ``x`` is copied into block 0
 * first. Round k sends the codes and the first blocks held to rank + 2^k, on tag + k, those that do
 * not fit ``capacity`` in a tail on tag + k + tail_offset, and appends what comes from rank - 2^k
 * (its tail received into place once its head is in), keeping the codes' maxima. The GIL is
 * released; each wait tests its requests for ``spin`` seconds, and ``spin_per_byte`` more per byte of
 * the round's blocks, at most (yielding the core after the
 * first few tests). Returns (round, high, negated, taken, head's receive, head's send, tail's send,
 * tail's receive): round -1, every round done; round k >= 0, round k is the Python's (its requests
 * as Fortran handles, MPI.Request.f2py; ``taken``: the head is in and the tail's receive posted):
 * a wait that lasts (it waits through the call's PeerWatch), or a head of another call or of
 * another length (it drops it, its tail too, as the Python's rounds do); round -2, an MPI error
 * (high: its code; the Python waits for the requests through its PeerWatch, which raises what they
 * failed with, then raises the code). */
#define CODES_BYTES 32

static double seconds_now(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* what a run of the rounds leaves: the requests (the head's receive, the head's send, the tail's
 * send, the tail's receive), the round it stopped at (-1: none; -2: an MPI error, ``error``), the
 * codes' maxima, and whether the stopped round's head was taken in */
typedef struct {
    MPI_Request requests[4];
    int stopped, taken, error;
    long long high, negated;
} Rounds;

/* the rounds, with the GIL released by the caller (``r``'s high and negated: this rank's codes).
 * ``direct`` on 2 ranks (one round, block 0 sent whole): the head's blocks are copied, the tail is
 * sent from ``x`` where it lies, so block 0 holds the head's bytes only (the short path reduces
 * from x; what owns it is kept while a send may read it: carried_rounds) */
static void run_rounds(MPI_Comm comm, int tag, int size, int rank, char *work, long long capacity, const void *x,
                       long long nbytes, long long number, double spin, double spin_per_byte, int tail_offset,
                       int direct, Rounds *r)
{
    char *incoming = work + CODES_BYTES + (size_t)size * (size_t)nbytes;
    int round = 0, error = MPI_SUCCESS;
    long long high = r->high, negated = r->negated;
    for (int i = 0; i < 4; i++)
        r->requests[i] = MPI_REQUEST_NULL;
    r->stopped = -1;
    r->taken = 0;
    direct = direct && size == 2;
    if (!direct)
        memcpy(work + CODES_BYTES, x, (size_t)nbytes);
    long long held = 1;
    for (int distance = 1; distance < size; distance *= 2, round++) {
        long long count = held < size - held ? held : size - held, total = count * nbytes;
        long long room = capacity - CODES_BYTES, half = (total + 1) / 2;
        long long head = total <= room ? total : (half < room ? half : room), tail = total - head;
        long long codes[4] = {high, negated, number, tail};
        int source = (rank - distance % size + size) % size, to = (rank + distance) % size, taken = 0;
        MPI_Request *requests = r->requests;
        memcpy(work, codes, CODES_BYTES);
        if (direct)
            memcpy(work + CODES_BYTES, x, (size_t)head);
        error = MPI_Irecv(incoming, (int)capacity, MPI_BYTE, source, tag + round, comm, &requests[0]);
        if (error == MPI_SUCCESS)
            error = MPI_Isend(work, (int)(CODES_BYTES + head), MPI_BYTE, to, tag + round, comm, &requests[1]);
        if (error == MPI_SUCCESS && tail)
            error = MPI_Isend(direct ? (const char *)x + head : work + CODES_BYTES + head, (int)tail, MPI_BYTE, to,
                              tag + round + tail_offset, comm, &requests[2]);
        int done = 0, tests = 0;
        double give_up = seconds_now() + spin + (double)total * spin_per_byte;
        while (error == MPI_SUCCESS) {
            if (!taken) {
                int in = 0;
                error = MPI_Test(&requests[0], &in, MPI_STATUS_IGNORE);
                if (error == MPI_SUCCESS && in) {
                    memcpy(codes, incoming, CODES_BYTES);
                    if (codes[2] != number || codes[3] != tail)
                        break;  /* another call's message, or another length's: the Python's */
                    taken = 1;
                    if (tail)
                        error = MPI_Irecv(work + CODES_BYTES + held * nbytes + head, (int)tail, MPI_BYTE, source,
                                          tag + round + tail_offset, comm, &requests[3]);
                    continue;
                }
            } else {
                error = MPI_Testall(3, requests + 1, &done, MPI_STATUSES_IGNORE);
                if (error == MPI_SUCCESS && done)
                    break;
            }
            if (seconds_now() > give_up)
                break;
            if (++tests > 64)
                sched_yield();
        }
        r->taken = taken;
        if (error != MPI_SUCCESS || !done) {
            r->stopped = error != MPI_SUCCESS ? -2 : round;
            break;
        }
        high = codes[0] > high ? codes[0] : high;
        negated = codes[1] > negated ? codes[1] : negated;
        memcpy(work + CODES_BYTES + held * nbytes, incoming + CODES_BYTES, (size_t)head);
        held += count;
    }
    r->error = error;
    r->high = r->stopped == -2 ? error : high;
    r->negated = negated;
}

/* (round, high, negated, taken, the four requests as Fortran handles): exchange_rounds' result */
static PyObject *rounds_result(const Rounds *r)
{
    return Py_BuildValue("iLLiiiii", r->stopped, r->high, r->negated, r->taken, (int)MPI_Request_c2f(r->requests[0]),
                         (int)MPI_Request_c2f(r->requests[1]), (int)MPI_Request_c2f(r->requests[2]),
                         (int)MPI_Request_c2f(r->requests[3]));
}

/* whether a run of the rounds over ``nbytes`` fits (0 with ValueError set where not) */
static int rounds_fit(long long nbytes, int size, long long capacity)
{
    if (nbytes <= 0 || size < 1 || capacity > INT_MAX || capacity <= CODES_BYTES || (long long)size * nbytes > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "exchange_rounds: x is not nbytes long, or a message would pass INT_MAX");
        return 0;
    }
    return 1;
}

static PyObject *exchange_rounds(PyObject *unused, PyObject *args)
{
    unsigned long long comm_handle, work_address;
    int tag, size, rank, tail_offset;
    long long capacity, nbytes, high, negated, number;
    double spin, spin_per_byte;
    Py_buffer x;
    if (!PyArg_ParseTuple(args, "KiiiKLy*LLLLddi", &comm_handle, &tag, &size, &rank, &work_address, &capacity, &x,
                          &nbytes, &high, &negated, &number, &spin, &spin_per_byte, &tail_offset))
        return NULL;
    if (x.len != nbytes || !rounds_fit(nbytes, size, capacity)) {
        PyBuffer_Release(&x);
        if (!PyErr_Occurred())
            rounds_fit(0, 0, 0);
        return NULL;
    }
    Rounds r = {.high = high, .negated = negated};
    Py_BEGIN_ALLOW_THREADS
    run_rounds((MPI_Comm)(uintptr_t)comm_handle, tag, size, rank, (char *)(uintptr_t)work_address, capacity, x.buf,
               nbytes, number, spin, spin_per_byte, tail_offset, 0, &r);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    return rounds_result(&r);
}

/* ---- ShortPath ----------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    MPI_Comm comm;
    MPI_Op op;
    MPI_Datatype datatype;
    int count, ndim, compares;
    Py_ssize_t shape[MAX_DIMENSIONS], strides[MAX_DIMENSIONS];
    long long code;
    Division division;          /* a mean's, in C (else ``then``) */
    long long *mine, **others;  /* the shared slots (SignatureSlots): this rank's and its peers' */
    Py_ssize_t n_others;
    PyObject *state;            /* vars(state) */
    PyObject *slots, *library;  /* what was bound: a call whose state holds others goes to Python */
    PyObject *dtype, *empty, *shape_tuple, *starts, *made, *compare, *failed, *then, *keep;
    /* the rounds on the signature's tags (where ``rounds`` was bound: compiled.short_path): with
     * ``compares``, the codes alone in place of the slots, before MPI_Allreduce; else dissemination's
     * blocks behind them, in place of the slots and MPI_Allreduce, then a reduction in rank order
     * (MPI_Reduce_local) */
    PyObject *held, *rest, *mismatch;  /* [space, pieces, its address] (a new one after a call given up),
                                        * the Python's rounds from a wait that lasts, a mismatch raised */
    PyObject *variables;               /* signature_messages' module's: SPIN_SECONDS(_PER_BYTE), read at each call */
    int base, slot, size, rank, tail_offset;
    long long calls_apart, capacity;
} ShortPath;

static int short_traverse(ShortPath *self, visitproc visit, void *arg)
{
    Py_VISIT(self->state); Py_VISIT(self->slots); Py_VISIT(self->library); Py_VISIT(self->dtype);
    Py_VISIT(self->empty); Py_VISIT(self->shape_tuple); Py_VISIT(self->starts); Py_VISIT(self->made);
    Py_VISIT(self->compare); Py_VISIT(self->failed); Py_VISIT(self->then); Py_VISIT(self->keep);
    Py_VISIT(self->held); Py_VISIT(self->rest); Py_VISIT(self->mismatch); Py_VISIT(self->variables);
    return 0;
}

static int short_clear(ShortPath *self)
{
    Py_CLEAR(self->state); Py_CLEAR(self->slots); Py_CLEAR(self->library); Py_CLEAR(self->dtype);
    Py_CLEAR(self->empty); Py_CLEAR(self->shape_tuple); Py_CLEAR(self->starts); Py_CLEAR(self->made);
    Py_CLEAR(self->compare); Py_CLEAR(self->failed); Py_CLEAR(self->then); Py_CLEAR(self->keep);
    Py_CLEAR(self->held); Py_CLEAR(self->rest); Py_CLEAR(self->mismatch); Py_CLEAR(self->variables);
    return 0;
}

static void short_dealloc(ShortPath *self)
{
    PyObject_GC_UnTrack(self);
    short_clear(self);
    PyMem_Free(self->others);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t address_of(PyObject *number)
{
    return (Py_ssize_t)PyLong_AsSsize_t(number);
}

/* ShortPath(comm, op, datatype, compares, code, vars(state), slots, library, mine, others, shape,
 *           strides, dtype, empty, starts, made, compare, failed, then, (kind, multiply, factor), keep
 *           [, rounds]) handles and addresses as ints; ``mine``: this rank's slot's address (0: no
 *           slots), ``others``: a tuple of its peers'; ``rounds``: (held, rest, mismatch, base, slot,
 *           calls_apart, size, rank, capacity, variables, tail_offset), dissemination's or the check's
 *           in messages (with ``compares``), or None */
static PyObject *short_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    unsigned long long comm, op, datatype;
    int compares;
    long long code;
    PyObject *state, *slots, *library, *mine, *others, *shape, *strides, *dtype, *empty, *starts, *made;
    PyObject *compare, *failed, *then, *keep, *rounds = Py_None, *held = NULL, *rest = NULL, *mismatch = NULL;
    PyObject *variables = NULL;
    Division division;
    if (!PyArg_ParseTuple(args, "KKKpLO!OOOO!O!O!OOO!O!OOO(iid)O|O", &comm, &op, &datatype, &compares, &code, &PyDict_Type,
                          &state, &slots, &library, &mine, &PyTuple_Type, &others, &PyTuple_Type, &shape,
                          &PyTuple_Type, &strides, &dtype, &empty, &PyList_Type, &starts, &PyList_Type, &made, &compare, &failed,
                          &then, &division.kind, &division.multiply, &division.factor, &keep, &rounds))
        return NULL;
    int base = 0, slot = 0, size = 0, rank = 0, tail_offset = 0;
    long long calls_apart = 0, capacity = 0;
    if (rounds != Py_None && !PyArg_ParseTuple(rounds, "O!OOiiLiiLO!i", &PyList_Type, &held, &rest, &mismatch, &base,
                                               &slot, &calls_apart, &size, &rank, &capacity, &PyDict_Type, &variables,
                                               &tail_offset))
        return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > MAX_DIMENSIONS || PyTuple_GET_SIZE(strides) != ndim) {
        PyErr_SetString(PyExc_ValueError, "ShortPath: at most MAX_DIMENSIONS dimensions, one stride each");
        return NULL;
    }
    ShortPath *self = (ShortPath *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->comm = (MPI_Comm)(uintptr_t)comm;
    self->op = (MPI_Op)(uintptr_t)op;
    self->datatype = (MPI_Datatype)(uintptr_t)datatype;
    self->compares = compares;
    self->code = code;
    self->division = division;
    self->ndim = (int)ndim;
    Py_ssize_t count = 1;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        self->shape[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        self->strides[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(strides, i));
        count *= self->shape[i];
    }
    self->count = (int)count;
    self->mine = (long long *)(uintptr_t)address_of(mine);
    self->n_others = PyTuple_GET_SIZE(others);
    self->others = PyMem_Calloc(self->n_others ? self->n_others : 1, sizeof(long long *));
    if (self->others == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < self->n_others; i++)
        self->others[i] = (long long *)(uintptr_t)address_of(PyTuple_GET_ITEM(others, i));
    if (PyErr_Occurred() || count > 0x7fffffff) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "ShortPath: more elements than an MPI count holds");
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(state); self->state = state;
    Py_INCREF(slots); self->slots = slots;
    Py_INCREF(library); self->library = library;
    Py_INCREF(dtype); self->dtype = dtype;
    Py_INCREF(empty); self->empty = empty;
    Py_INCREF(shape); self->shape_tuple = shape;
    Py_INCREF(starts); self->starts = starts;
    Py_INCREF(made); self->made = made;
    Py_INCREF(compare); self->compare = compare;
    Py_INCREF(failed); self->failed = failed;
    Py_INCREF(then); self->then = then;
    Py_INCREF(keep); self->keep = keep;
    Py_XINCREF(held); self->held = held;
    Py_XINCREF(rest); self->rest = rest;
    Py_XINCREF(mismatch); self->mismatch = mismatch;
    Py_XINCREF(variables); self->variables = variables;
    self->base = base; self->slot = slot; self->calls_apart = calls_apart; self->size = size; self->rank = rank;
    self->capacity = capacity; self->tail_offset = tail_offset;
    if (held != NULL && (size < 2 || calls_apart < 1 || !rounds_fit(1, size, capacity))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "ShortPath: dissemination's rounds need 2 ranks or more, and a slot of tags");
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* SignatureSlots.agree: publish the code of call #number, then whether every peer has published
 * the same (0: not yet there, or differs: Python's compare waits and says which) */
static int agree(ShortPath *self, long long number)
{
    int at = 2 * (int)(number & 1);
    __atomic_store_n(&self->mine[at], self->code, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);  /* (MPI_Win_sync) */
    __atomic_store_n(&self->mine[at + 1], number, __ATOMIC_RELAXED);
    for (Py_ssize_t i = 0; i < self->n_others; i++)
        if (__atomic_load_n(&self->others[i][at + 1], __ATOMIC_RELAXED) != number)
            return 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    for (Py_ssize_t i = 0; i < self->n_others; i++)
        if (__atomic_load_n(&self->others[i][at], __ATOMIC_RELAXED) != self->code)
            return 0;
    return 1;
}

/* symmetric.touches: whether ``address`` lies in this rank's segment of a symmetric allocation
 * (``starts``, sorted, and ``made``: symmetric._STARTS and _MADE, bisected here as there); -1 with
 * an exception set */
static int in_symmetric(ShortPath *self, const void *address)
{
    unsigned long long at = (unsigned long long)(uintptr_t)address, start;
    Py_ssize_t low = 0, high = PyList_GET_SIZE(self->starts);
    while (low < high) {  /* (bisect_right) */
        Py_ssize_t middle = (low + high) / 2;
        start = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(self->starts, middle));
        if (start == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        if (at < start)
            high = middle;
        else
            low = middle + 1;
    }
    if (low == 0 || low > PyList_GET_SIZE(self->made))
        return 0;
    start = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(self->starts, low - 1));
    PyObject *nbytes = PyObject_GetAttr(PyList_GET_ITEM(self->made, low - 1), s_nbytes);
    if (nbytes == NULL)
        return -1;
    unsigned long long length = PyLong_AsUnsignedLongLong(nbytes);
    Py_DECREF(nbytes);
    if (length == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return at < start + length;
}

/* whether the buffer is laid out as bound (shape and strides) */
static int laid_out(ShortPath *self, Py_buffer *view)
{
    if (view->ndim != self->ndim)
        return 0;
    for (int i = 0; i < self->ndim; i++)
        if (view->shape[i] != self->shape[i] || view->strides[i] != self->strides[i])
            return 0;
    return 1;
}

/* a buffer of ``array`` laid out as bound: 1; 0 (no error set) where the Python path must look */
static int view_of(ShortPath *self, PyObject *array, Py_buffer *view, int writable)
{
    if (PyObject_GetBuffer(array, view, PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();  /* (read-only, say: the Python path says so) */
        return 0;
    }
    if (!laid_out(self, view)) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* a float of the rounds' module (``name``: SPIN_SECONDS, SPIN_SECONDS_PER_BYTE); 0, or -1 with an
 * exception set */
static int spin_variable(ShortPath *self, PyObject *name, double *value)
{
    PyObject *now = PyDict_GetItemWithError(self->variables, name);
    *value = now == NULL ? -1.0 : PyFloat_AsDouble(now);
    if (*value == -1.0 && (now == NULL || PyErr_Occurred())) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_AttributeError, "ShortPath: the rounds' module has no %U", name);
        return -1;
    }
    return 0;
}

/* the buffer and the spin of the rounds on the signature's tags (spin[0]: seconds, spin[1]: more per
 * byte; read before the call is numbered: what could fail on one rank alone is behind); 0, or -1
 * with an exception set */
static int rounds_ready(ShortPath *self, char **work, double *spin)
{
    PyObject *address = PyList_GET_SIZE(self->held) == 3 ? PyList_GET_ITEM(self->held, 2) : NULL;
    *work = address == NULL ? NULL : (char *)PyLong_AsVoidPtr(address);
    if (*work == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "ShortPath: no buffer bound for the rounds");
        return -1;
    }
    return spin_variable(self, s_spin, &spin[0]) < 0 || spin_variable(self, s_spin_per_byte, &spin[1]) < 0 ? -1 : 0;
}

/* call #number's rounds on its signature tags, carrying ``nbytes`` of ``x`` (dissemination's
 * blocks) or the codes alone (``nbytes`` 0: the check in messages before MPI_Allreduce, message
 * for message signature_messages.codes_agree_by_messages'), resumed in the Python from a wait that
 * lasts (rest), the maxima settled (mismatch raises on every rank where any rank's call differs).
 * 0, or -1 with what ``failed`` raised */
static int carried_rounds(ShortPath *self, char *work, const double *spin, const void *x, PyObject *owner,
                          long long nbytes, long long number)
{
    Rounds r = {.high = self->code, .negated = -self->code};
    Py_BEGIN_ALLOW_THREADS
    run_rounds(self->comm, (int)((number % self->calls_apart) * self->slot + self->base), self->size, self->rank,
               work, self->capacity, x, nbytes, number, spin[0], spin[1], self->tail_offset, owner != Py_None, &r);
    Py_END_ALLOW_THREADS
    long long high = r.high, negated = r.negated;
    if (r.stopped != -1) {  /* (a wait that lasts, a message left to the Python, an MPI error: through a watch;
                             * ``owner``, what x lies in, kept with the requests if the call is given up) */
        PyObject *got = PyObject_CallFunction(self->rest, "LiLLi(iiii)O", number, r.stopped, r.high, r.negated, r.taken,
                                              (int)MPI_Request_c2f(r.requests[0]), (int)MPI_Request_c2f(r.requests[1]),
                                              (int)MPI_Request_c2f(r.requests[2]), (int)MPI_Request_c2f(r.requests[3]),
                                              owner);
        int parsed = got != NULL && PyArg_ParseTuple(got, "LL", &high, &negated);
        Py_XDECREF(got);
        if (!parsed) {
            failed_with(self->failed, MPI_SUCCESS, number);
            return -1;
        }
    }
    if (high != -negated) {  /* (every rank has the same maxima: the same error everywhere) */
        PyObject *raised = PyObject_CallFunction(self->mismatch, "LLL", number, high, negated);
        if (raised != NULL) {
            Py_DECREF(raised);
            PyErr_SetString(PyExc_RuntimeError, "ShortPath: the signatures differ, and mismatch() did not raise");
        }
        failed_with(self->failed, MPI_SUCCESS, number);
        return -1;
    }
    return 0;
}

/* dissemination's rounds carrying the signature (numbered first, as the Python path numbers a
 * call whose algorithm talks on its tags), then the blocks reduced in rank order: rank 0's copied,
 * each next one's reduced into it (MPI_Reduce_local: in (op) inout, the same IEEE sum as numpy's
 * left to right, a + b being b + a; dissemination.reduce_in_order does the same on the Python
 * path, so NaN payloads agree too), a mean divided. Py_None, or NULL with what ``failed`` raised */
static PyObject *dissemination_run(ShortPath *self, PyObject *owner, const void *x, Py_buffer *recv)
{
    char *work;
    double spin[2];
    if (rounds_ready(self, &work, spin) < 0)
        return NULL;
    long long number = next_number(self->state);
    if (number < 0)
        return NULL;
    long long nbytes = recv->len;
    if (carried_rounds(self, work, spin, x, owner, nbytes, number) < 0)
        return NULL;
    int code = MPI_SUCCESS;
    char *blocks = work + CODES_BYTES;  /* (block j holds rank - j's input) */
    Py_BEGIN_ALLOW_THREADS
    if (self->size == 2) {  /* (block 0 is x, where it lies: run_rounds' direct; rank 0's input is the first) */
        char *peer = blocks + nbytes;
        const void *first = self->rank == 0 ? x : peer, *second = self->rank == 0 ? (const void *)peer : x;
        if (recv->buf == second) {  /* (in place on rank 1: reduced into the peer's block, then copied) */
            code = MPI_Reduce_local(second, peer, self->count, self->datatype, self->op);
            if (code == MPI_SUCCESS)
                memcpy(recv->buf, peer, (size_t)nbytes);
        } else {
            if (recv->buf != first)
                memcpy(recv->buf, first, (size_t)nbytes);
            code = MPI_Reduce_local(second, recv->buf, self->count, self->datatype, self->op);
        }
    } else {
        memcpy(recv->buf, blocks + (size_t)self->rank * (size_t)nbytes, (size_t)nbytes);
        for (int s = 1; s < self->size && code == MPI_SUCCESS; s++)
            code = MPI_Reduce_local(blocks + (size_t)((self->rank - s + self->size) % self->size) * (size_t)nbytes,
                                    recv->buf, self->count, self->datatype, self->op);
    }
    Py_END_ALLOW_THREADS
    if (code != MPI_SUCCESS)
        return failed_with(self->failed, code, number);
    if (self->division.kind)
        divide(&self->division, recv->buf, self->count);
    Py_RETURN_NONE;
}

static PyObject *short_run(ShortPath *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "run(x, out)");
        return NULL;
    }
    PyObject *x = args[0], *out = args[1], *result = NULL;
    Py_buffer send, recv;
    int in_place = out == x, sending = 0, receiving = 0;
    if (out == Py_None) {
        result = PyObject_CallFunctionObjArgs(self->empty, self->shape_tuple, self->dtype, NULL);
        if (result == NULL)
            return NULL;
    } else if (in_place) {
        Py_INCREF(x);
        result = x;
    } else {  /* another array: a numpy array of x's dtype, laid out as bound, not overlapping x */
        if (Py_TYPE(out) != Py_TYPE(x))
            goto python;
        PyObject *dtype = PyObject_GetAttr(out, s_dtype);
        if (dtype == NULL)
            return NULL;
        Py_DECREF(dtype);
        if (dtype != self->dtype)
            goto python;
        Py_INCREF(out);
        result = out;
    }
    if (!in_place) {
        if (!(sending = view_of(self, x, &send, 0)))
            goto python;
    }
    if (!(receiving = view_of(self, result, &recv, 1)))
        goto python;
    if (sending && out != Py_None && !in_place) {  /* (np.may_share_memory's bounds) */
        char *a = send.buf, *b = recv.buf;
        if (a < b + recv.len && b < a + send.len && recv.len)
            goto python;
    }
    if (PyList_GET_SIZE(self->made) != 0) {  /* (symmetric arrays may run single_copy: Python's) */
        int inside = in_symmetric(self, in_place ? recv.buf : send.buf);
        if (inside < 0)
            goto fail;
        if (inside)
            goto python;
    }
    PyObject *library = PyDict_GetItemWithError(self->state, s_library);
    if (library != self->library)  /* (the communicator was freed since: Python's path says so) */
        goto python;
    long long number = 0;
    int code;
    int blocks = self->held != NULL && !self->compares;  /* (else the rounds carry the codes alone) */
    if (blocks && (recv.len <= 0 || (long long)self->size * recv.len > INT_MAX))
        goto python;  /* (nothing to send, or more than a message holds: the Python's rounds) */
    if (blocks) {  /* dissemination's rounds, carrying the signature */
        PyObject *done = dissemination_run(self, x, in_place ? recv.buf : send.buf, &recv);
        if (done == NULL)
            goto fail;
        Py_DECREF(done);
        if (sending)
            PyBuffer_Release(&send);
        PyBuffer_Release(&recv);
        return result;
    }
    if (self->compares) {  /* in the shared slots, or in messages (held: across nodes, ULFM) */
        char *work = NULL;
        double spin[2] = {0.0, 0.0};
        PyObject *slots = PyDict_GetItemWithError(self->state, s_slots);
        if (slots == NULL && PyErr_Occurred())
            goto fail;
        if (self->held != NULL && slots != Py_None)
            goto python;  /* (slots made since it was bound: the Python's path) */
        if (self->held != NULL && rounds_ready(self, &work, spin) < 0)
            goto fail;
        number = next_number(self->state);
        if (number < 0)
            goto fail;
        if (self->held != NULL) {  /* the codes alone in the rounds: the check in messages, in C */
            if (carried_rounds(self, work, spin, work, Py_None, 0, number) < 0)
                goto fail;
        } else {
            int ours = slots != NULL && slots == self->slots && slots != Py_None;
            if (!ours || !agree(self, number)) {  /* (Python's compare: wait, compare, say what differs) */
                PyObject *done = PyObject_CallFunction(self->compare, "LO", number, ours ? Py_True : Py_False);
                if (done == NULL) {
                    failed_with(self->failed, MPI_SUCCESS, number);
                    goto fail;
                }
                Py_DECREF(done);
            }
        }
    }
    Py_BEGIN_ALLOW_THREADS
    code = MPI_Allreduce(in_place ? MPI_IN_PLACE : send.buf, recv.buf, self->count, self->datatype, self->op,
                         self->comm);
    Py_END_ALLOW_THREADS
    if (code == MPI_SUCCESS && self->division.kind)
        divide(&self->division, recv.buf, self->count);
    if (sending)
        PyBuffer_Release(&send);
    PyBuffer_Release(&recv);
    sending = receiving = 0;
    if (!self->compares) {
        number = next_number(self->state);  /* (after it, as the Python path numbers it) */
        if (number < 0)
            goto fail;
    }
    if (code != MPI_SUCCESS) {
        failed_with(self->failed, code, number);
        goto fail;
    }
    if (!self->division.kind && self->then != Py_None) {
        PyObject *done = PyObject_CallOneArg(self->then, result);
        if (done == NULL) {
            failed_with(self->failed, MPI_SUCCESS, number);
            goto fail;
        }
        Py_DECREF(done);
    }
    return result;
python:
    if (sending)
        PyBuffer_Release(&send);
    if (receiving)
        PyBuffer_Release(&recv);
    Py_XDECREF(result);
    Py_RETURN_NONE;
fail:
    if (sending)
        PyBuffer_Release(&send);
    if (receiving)
        PyBuffer_Release(&recv);
    Py_XDECREF(result);
    return NULL;
}

static PyMethodDef short_methods[] = {
    {"run", (PyCFunction)(void (*)(void))short_run, METH_FASTCALL,
     "run(x, out): the result, or None where the Python path must take the call"},
    {NULL}
};

static PyTypeObject ShortPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpiallreduce.core._compiled.ShortPath",
    .tp_basicsize = sizeof(ShortPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The short path of a repeated plain call of MPI's own allreduce, compiled (see _compiled.c).",
    .tp_new = short_new,
    .tp_dealloc = (destructor)short_dealloc,
    .tp_traverse = (traverseproc)short_traverse,
    .tp_clear = (inquiry)short_clear,
    .tp_methods = short_methods,
};

static PyMethodDef module_methods[] = {
    {"exchange_rounds", exchange_rounds, METH_VARARGS,
     "exchange_rounds(comm, tag, size, rank, work, capacity, x, nbytes, high, negated, number, spin, spin_per_byte, "
     "tail_offset): "
     "dissemination's rounds"},
    {NULL}
};

/* ---- the module ---------------------------------------------------------------------------- */

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_compiled", "The hot paths of repeated calls, compiled (see _compiled.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__compiled(void)
{
    if (!(s_pending = PyUnicode_InternFromString("pending")) || !(s_recorder = PyUnicode_InternFromString("recorder"))
        || !(s_sequence = PyUnicode_InternFromString("sequence")) || !(s_call = PyUnicode_InternFromString("_call"))
        || !(s_slots = PyUnicode_InternFromString("signature_slots"))
        || !(s_library = PyUnicode_InternFromString("library")) || !(s_dtype = PyUnicode_InternFromString("dtype"))
        || !(s_nbytes = PyUnicode_InternFromString("nbytes")) || !(s_spin = PyUnicode_InternFromString("SPIN_SECONDS"))
        || !(s_spin_per_byte = PyUnicode_InternFromString("SPIN_SECONDS_PER_BYTE"))
        || !(s_ahead = PyUnicode_InternFromString("given_up_ahead")))
        return NULL;
    if (PyType_Ready(&PreparedBaseType) < 0 || PyType_Ready(&ShortPathType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PreparedBaseType);
    if (PyModule_AddObject(m, "PreparedBase", (PyObject *)&PreparedBaseType) < 0) {
        Py_DECREF(&PreparedBaseType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_DIMENSIONS", MAX_DIMENSIONS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ShortPathType);
    if (PyModule_AddObject(m, "ShortPath", (PyObject *)&ShortPathType) < 0) {
        Py_DECREF(&ShortPathType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
