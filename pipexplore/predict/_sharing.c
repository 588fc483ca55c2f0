/* The simulator's processor-sharing event loop, its graph's level sort and longest path, compiled.
 *
 * The same loop as pipexplore.predict.simulator._sharing_loop (the reference, which runs where this module
 * was not built), step for step and with the same floating-point operations in the same order, so
 * both give the same timeline bit for bit (tests compare them). Python runs it at a few µs an
 * event; a 1,000-layer × 64-stage × 256-micro-batch step on one host has ~100k events.
 *
 * run(took, asked, first_wait, second_wait, copy, first, second, stage, kind, queue_len,
 *     resource, free, lanes_at, lanes, gap, forward, backward, input_grad,
 *     out_action, out_start, out_end, out_copy) -> rows
 *
 * Per action (n of them; numbered queue after queue): float64 took, asked, first_wait,
 * second_wait, copy; int64 first, second (input action numbers, n = none), stage, kind.
 * Per queue (worker): int64 queue_len. Per stage: int64 resource (its device's number; `free`
 * is the number of the clock for actions that ask for none of their device); lanes_at (S + 1
 * offsets) and lanes: the queues that run each stage's actions. Out, 2n each: the rows in the
 * order the loop emits them: action number, start, end, and 1 for the copy before a forward.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double key;
    int64_t tie;
    int64_t q;
} Entry;

typedef struct {
    Entry *at;
    Py_ssize_t size, capacity;
} Heap;

static int less(const Entry *a, const Entry *b) {
    return a->key < b->key || (a->key == b->key && a->tie < b->tie);
}

static int heap_push(Heap *h, double key, int64_t tie, int64_t q) {
    if (h->size == h->capacity) {
        Py_ssize_t capacity = h->capacity ? 2 * h->capacity : 64;
        Entry *grown = realloc(h->at, (size_t)capacity * sizeof(Entry));
        if (!grown) return -1;
        h->at = grown;
        h->capacity = capacity;
    }
    Py_ssize_t i = h->size++;
    Entry e = {key, tie, q};
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (!less(&e, &h->at[parent])) break;
        h->at[i] = h->at[parent];
        i = parent;
    }
    h->at[i] = e;
    return 0;
}

static Entry heap_pop(Heap *h) {
    Entry top = h->at[0];
    Entry last = h->at[--h->size];
    Py_ssize_t i = 0, n = h->size;
    while (1) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && less(&h->at[child + 1], &h->at[child])) child++;
        if (!less(&h->at[child], &last)) break;
        h->at[i] = h->at[child];
        i = child;
    }
    if (n) h->at[i] = last;
    return top;
}

/* A buffer argument of `count` items of `itemsize` bytes, or a Python error. */
static int check(Py_buffer *b, Py_ssize_t count, Py_ssize_t itemsize, const char *name) {
    if (b->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd bytes, got %zd", name, count * itemsize, b->len);
        return -1;
    }
    return 0;
}

static PyObject *run(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b[17];
    double gap;
    long long forward, backward, input_grad;
    long long free_id;
    memset(b, 0, sizeof(b));
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*y*y*y*Ly*y*dLLLw*w*w*w*",
                          &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6], &b[7], &b[8], &b[9], &b[10], &free_id,
                          &b[11], &b[12], &gap, &forward, &backward, &input_grad, &b[13], &b[14], &b[15], &b[16]))
        return NULL;
    PyObject *result = NULL;
    /* How many actions: the graph's (its stage numbers); every other per-action array must match. */
    const Py_ssize_t n = b[7].len / 8, Q = b[9].len / 8, S = b[10].len / 8;
    const char *names[] = {"took", "asked", "first_wait", "second_wait", "copy", "first", "second", "stage",
                           "kind"};
    for (int i = 0; i < 9; i++)
        if (check(&b[i], n, 8, names[i])) goto release;
    if (check(&b[11], S + 1, 8, "lanes_at") || check(&b[13], 2 * n, 8, "out_action") ||
        check(&b[14], 2 * n, 8, "out_start") || check(&b[15], 2 * n, 8, "out_end") ||
        check(&b[16], 2 * n, 1, "out_copy"))
        goto release;

    const double *took = b[0].buf, *asked = b[1].buf, *first_wait = b[2].buf, *second_wait = b[3].buf,
                 *copy_of = b[4].buf;
    const int64_t *first = b[5].buf, *second = b[6].buf, *stage = b[7].buf, *kind = b[8].buf,
                  *length = b[9].buf, *resource = b[10].buf, *lanes_at = b[11].buf, *lanes = b[12].buf;
    int64_t *out_action = b[13].buf;
    double *out_start = b[14].buf, *out_end = b[15].buf;
    int8_t *out_copy = b[16].buf;
    const Py_ssize_t R = free_id + 1; /* devices, then the free clock */
    for (Py_ssize_t s = 0; s < S; s++)
        if (resource[s] < 0 || resource[s] >= free_id) {
            PyErr_SetString(PyExc_ValueError, "resource: a stage's device number is out of range");
            goto release;
        }
    if (lanes_at[0] != 0 || lanes_at[S] * 8 != b[12].len) {
        PyErr_SetString(PyExc_ValueError, "lanes_at does not bound lanes");
        goto release;
    }
    for (Py_ssize_t i = 0; i < lanes_at[S]; i++)
        if (lanes[i] < 0 || lanes[i] >= Q) {
            PyErr_SetString(PyExc_ValueError, "lanes: a queue number is out of range");
            goto release;
        }
    {
        Py_ssize_t total = 0;
        for (Py_ssize_t q = 0; q < Q; q++) total += length[q];
        if (total != n) {
            PyErr_SetString(PyExc_ValueError, "queue_len does not add up to the actions");
            goto release;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            if (first[i] < 0 || first[i] > n || second[i] < 0 || second[i] > n || stage[i] < 0 || stage[i] >= S) {
                PyErr_SetString(PyExc_ValueError, "an action's input or stage is out of range");
                goto release;
            }
    }

    /* State, as the Python loop's: end per action (-1 not yet done; the sentinel ended at 0). */
    double *end = malloc((size_t)(n + 1) * sizeof(double));
    int64_t *base = malloc((size_t)(Q + 1) * sizeof(int64_t)), *heads = calloc((size_t)Q + 1, sizeof(int64_t));
    double *free_at = calloc((size_t)Q + 1, sizeof(double)), *timed = malloc((size_t)(Q + 1) * sizeof(double));
    char *has_timed = calloc((size_t)Q + 1, 1), *dirty = malloc((size_t)Q + 1), *is_running = calloc((size_t)Q + 1, 1);
    /* The queues marked to look at (each once: `dirty` says which are). */
    int64_t *dirty_list = malloc((size_t)(Q + 1) * sizeof(int64_t));
    Py_ssize_t ndirty = 0;
#define MARK(queue)                        \
    do {                                   \
        int64_t q_ = (queue);              \
        if (!dirty[q_]) {                  \
            dirty[q_] = 1;                 \
            dirty_list[ndirty++] = q_;     \
        }                                  \
    } while (0)
    /* What runs on each queue: its clock (resource), share, start and action. */
    int64_t *run_r = malloc((size_t)(Q + 1) * sizeof(int64_t)), *run_n = malloc((size_t)(Q + 1) * sizeof(int64_t));
    double *run_share = malloc((size_t)(Q + 1) * sizeof(double)), *run_start = malloc((size_t)(Q + 1) * sizeof(double));
    /* Per clock: its time, what its actions ask for, a heap of their ends; and the order in which the
     * clocks were first used (the Python loop's dict order). */
    double *clock = calloc((size_t)R, sizeof(double)), *demand = calloc((size_t)R, sizeof(double));
    Heap *finishing = calloc((size_t)R, sizeof(Heap));
    char *seen = calloc((size_t)R, 1);
    int64_t *seen_order = malloc((size_t)R * sizeof(int64_t));
    int64_t *advancing = malloc((size_t)R * sizeof(int64_t));
    double *advancing_rate = malloc((size_t)R * sizeof(double));
    Heap wakes = {NULL, 0, 0};
    if (!end || !base || !heads || !free_at || !timed || !has_timed || !dirty || !dirty_list || !is_running || !run_r ||
        !run_n ||
        !run_share || !run_start || !clock || !demand || !finishing || !seen || !seen_order || !advancing ||
        !advancing_rate) {
        PyErr_NoMemory();
        goto free_state;
    }
    for (Py_ssize_t i = 0; i < n; i++) end[i] = -1.0;
    end[n] = 0.0;
    base[0] = 0;
    for (Py_ssize_t q = 1; q < Q; q++) base[q] = base[q - 1] + length[q - 1];
    memset(dirty, 1, (size_t)Q);
    for (Py_ssize_t q = 0; q < Q; q++) dirty_list[q] = q;
    ndirty = Q;

    Py_ssize_t rows = 0, seen_count = 0, remaining = n;
    int64_t order = 0;
    double now = 0.0;
    const double eps = 1e-12;
    int failed = 0;

    Py_BEGIN_ALLOW_THREADS
    while (remaining) {
        while (wakes.size && wakes.at[0].key <= now + eps) {
            Entry w = heap_pop(&wakes);
            if (has_timed[w.q] && timed[w.q] == w.key) {
                has_timed[w.q] = 0;
                MARK(w.q);
            }
        }
        /* The queues to look at, in ascending order (as the Python loop's sorted set): a handful
         * per event, so an insertion sort. */
        for (Py_ssize_t i = 1; i < ndirty; i++) {
            int64_t q = dirty_list[i];
            Py_ssize_t j = i;
            for (; j > 0 && dirty_list[j - 1] > q; j--) dirty_list[j] = dirty_list[j - 1];
            dirty_list[j] = q;
        }
        Py_ssize_t looked = ndirty;
        ndirty = 0;
        for (Py_ssize_t i = 0; i < looked; i++) {
            int64_t q = dirty_list[i];
            dirty[q] = 0;
            if (is_running[q] || heads[q] >= length[q]) continue;
            int64_t a = base[q] + heads[q];
            double t = end[first[a]];
            if (t < 0) continue;
            t += first_wait[a];
            double later = end[second[a]];
            if (later < 0) continue;
            later += second_wait[a];
            if (later > t) t = later;
            double start = free_at[q] > t ? free_at[q] : t;
            if (start > now + eps) {
                if (!has_timed[q] || timed[q] != start) {
                    has_timed[q] = 1;
                    timed[q] = start;
                    if (heap_push(&wakes, start, q, q)) { failed = 1; break; }
                }
                continue;
            }
            double share = asked[a];
            int64_t r = share > 0 ? resource[stage[a]] : free_id;
            if (!seen[r]) {
                seen[r] = 1;
                seen_order[seen_count++] = r;
            }
            if (!finishing[r].size) {
                clock[r] = 0.0;
                demand[r] = 0.0;
            }
            if (heap_push(&finishing[r], clock[r] + took[a], order, q)) { failed = 1; break; }
            order++;
            demand[r] += share;
            is_running[q] = 1;
            run_r[q] = r;
            run_share[q] = share;
            run_start[q] = now;
            run_n[q] = a;
            if (copy_of[a] > 0) {
                double done = end[first[a]];
                out_action[rows] = a;
                out_start[rows] = done;
                out_end[rows] = done + copy_of[a];
                out_copy[rows++] = 1;
            }
        }
        if (failed) break;
        while (wakes.size && !(has_timed[wakes.at[0].q] && timed[wakes.at[0].q] == wakes.at[0].key))
            heap_pop(&wakes); /* stale */
        double wake = wakes.size ? wakes.at[0].key : INFINITY;
        double step = wake - now;
        Py_ssize_t moving = 0;
        for (Py_ssize_t i = 0; i < seen_count; i++) {
            int64_t r = seen_order[i];
            if (!finishing[r].size) continue;
            double d = demand[r];
            double rate = r != free_id && d > 1.0 ? 1.0 / d : 1.0;
            double left = (finishing[r].at[0].key - clock[r]) / rate;
            if (left < step) step = left;
            advancing[moving] = r;
            advancing_rate[moving++] = rate;
        }
        if (!moving) {
            if (isinf(wake)) { failed = 2; break; }
            now = wake;
            continue;
        }
        now += step;
        double tolerance = eps * (now > 1.0 ? now : 1.0);
        for (Py_ssize_t i = 0; i < moving; i++) {
            int64_t r = advancing[i];
            Heap *heap = &finishing[r];
            double at = clock[r] + step * advancing_rate[i];
            clock[r] = at;
            while (heap->size && heap->at[0].key - at <= tolerance) {
                int64_t q = heap_pop(heap).q;
                int64_t a = run_n[q];
                is_running[q] = 0;
                demand[r] -= run_share[q];
                heads[q]++;
                remaining--;
                end[a] = now;
                free_at[q] = now + gap;
                out_action[rows] = a;
                out_start[rows] = run_start[q];
                out_end[rows] = now;
                out_copy[rows++] = 0;
                int64_t s = stage[a], k = kind[a];
                for (int64_t j = lanes_at[s]; j < lanes_at[s + 1]; j++) MARK(lanes[j]);
                if (k == forward) {
                    if (s + 1 < S)
                        for (int64_t j = lanes_at[s + 1]; j < lanes_at[s + 2]; j++) MARK(lanes[j]);
                } else if ((k == backward || k == input_grad) && s > 0) {
                    for (int64_t j = lanes_at[s - 1]; j < lanes_at[s]; j++) MARK(lanes[j]);
                }
            }
        }
    }
    Py_END_ALLOW_THREADS

    if (failed == 1)
        PyErr_NoMemory();
    else if (failed == 2)
        PyErr_SetString(PyExc_RuntimeError, "the schedule deadlocked: no stage can run its next action");
    else
        result = PyLong_FromSsize_t(rows);

free_state:
    free(end); free(base); free(heads); free(free_at); free(timed); free(has_timed); free(dirty); free(dirty_list);
    free(is_running);
    free(run_r); free(run_n); free(run_share); free(run_start); free(clock); free(demand); free(seen);
    free(seen_order); free(advancing); free(advancing_rate); free(wakes.at);
    if (finishing)
        for (Py_ssize_t r = 0; r < R; r++) free(finishing[r].at);
    free(finishing);
release:
    for (int i = 0; i < 17; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

/* times(after, first, second, seconds, after_wait, first_wait, second_wait, start, end): the longest
 * path of a graph whose actions come in level order (every input before its user; n = none):
 * each starts when the last of its inputs' ends plus its wait is reached, and takes its seconds.
 * The same operations as pipexplore.predict.dataflow.ActionGraph.times's array passes, action by action;
 * `end` has n + 1 places (the sentinel "no input", which ends at 0). */
static PyObject *times(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b[9];
    memset(b, 0, sizeof(b));
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*w*", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6], &b[7], &b[8]))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = b[0].len / 8;
    const char *names[] = {"after", "first", "second", "seconds", "after_wait", "first_wait", "second_wait", "start"};
    for (int i = 0; i < 8; i++)
        if (check(&b[i], n, 8, names[i])) goto release;
    if (check(&b[8], n + 1, 8, "end")) goto release;
    const int64_t *inputs[3] = {b[0].buf, b[1].buf, b[2].buf};
    for (int k = 0; k < 3; k++)
        for (Py_ssize_t i = 0; i < n; i++)
            if (inputs[k][i] < 0 || inputs[k][i] > n || (inputs[k][i] >= i && inputs[k][i] != n)) {
                PyErr_SetString(PyExc_ValueError, "an input does not come before its action (not in level order)");
                goto release;
            }
    const int64_t *after = b[0].buf, *first = b[1].buf, *second = b[2].buf;
    const double *seconds = b[3].buf, *after_wait = b[4].buf, *first_wait = b[5].buf, *second_wait = b[6].buf;
    double *start = b[7].buf, *end = b[8].buf;
    end[n] = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double t = end[after[i]] + after_wait[i];
        double u = end[first[i]] + first_wait[i];
        if (u > t) t = u;
        u = end[second[i]] + second_wait[i];
        if (u > t) t = u;
        start[i] = t;
        end[i] = t + seconds[i];
    }
    Py_INCREF(Py_None);
    result = Py_None;
release:
    for (int i = 0; i < 9; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

/* levels(after, first, second, level) -> placed: each action's level, one more than the highest of
 * its inputs' (Kahn's order), as pipexplore.predict.dataflow._levels computes it in Python. Inputs
 * are action numbers, n = none. Returns how many actions were placed: fewer than n when the graph
 * has a cycle (some worker waits for an action that waits for it). */
static PyObject *levels(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b[4];
    memset(b, 0, sizeof(b));
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &b[0], &b[1], &b[2], &b[3])) return NULL;
    PyObject *result = NULL;
    int64_t *users_at = NULL, *users = NULL, *waiting = NULL, *ready = NULL;
    const Py_ssize_t n = b[0].len / 8;
    const char *names[] = {"after", "first", "second", "level"};
    for (int i = 0; i < 4; i++)
        if (check(&b[i], n, 8, names[i])) goto release;
    const int64_t *inputs[3] = {b[0].buf, b[1].buf, b[2].buf};
    int64_t *level = b[3].buf;
    users_at = calloc((size_t)n + 1, sizeof(int64_t));
    users = malloc(((size_t)3 * n + 1) * sizeof(int64_t));
    waiting = calloc((size_t)n + 1, sizeof(int64_t));
    ready = malloc(((size_t)n + 1) * sizeof(int64_t));
    if (!users_at || !users || !waiting || !ready) {
        PyErr_NoMemory();
        goto release;
    }
    for (int k = 0; k < 3; k++)
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t m = inputs[k][i];
            if (m < 0 || m > n) {
                PyErr_SetString(PyExc_ValueError, "an input is not an action number");
                goto release;
            }
            if (m < n) {
                users_at[m + 1]++;
                waiting[i]++;
            }
        }
    for (Py_ssize_t i = 0; i < n; i++) users_at[i + 1] += users_at[i];
    {
        int64_t *fill = malloc(((size_t)n + 1) * sizeof(int64_t));
        if (!fill) {
            PyErr_NoMemory();
            goto release;
        }
        memcpy(fill, users_at, ((size_t)n + 1) * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < n; i++)  /* users in action order, as the Python loop lists them */
            for (int k = 0; k < 3; k++)
                if (inputs[k][i] < n) users[fill[inputs[k][i]]++] = i;
        free(fill);
    }
    Py_ssize_t top = 0, placed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        level[i] = 0;
        if (!waiting[i]) ready[top++] = i;
    }
    while (top) {
        int64_t v = ready[--top];
        placed++;
        for (int64_t j = users_at[v]; j < users_at[v + 1]; j++) {
            int64_t u = users[j];
            if (level[u] <= level[v]) level[u] = level[v] + 1;
            if (!--waiting[u]) ready[top++] = u;
        }
    }
    result = PyLong_FromSsize_t(placed);
release:
    free(users_at);
    free(users);
    free(waiting);
    free(ready);
    for (int i = 0; i < 4; i++)
        if (b[i].obj) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "The processor-sharing event loop (see pipexplore.predict.simulator)."},
    {"times", times, METH_VARARGS, "The longest path of a graph in level order (see pipexplore.predict.dataflow)."},
    {"levels", levels, METH_VARARGS, "Each action's level in its graph (see pipexplore.predict.dataflow._levels)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_sharing", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__sharing(void) { return PyModule_Create(&module); }
