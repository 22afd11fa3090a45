/* The launch record and the calls that native_launch.c (launches) and native_guard.c
 * (guarded launches, plan guards) share; both build into one module, _kiln_launch. */
#ifndef KILN_NATIVE_LAUNCH_H
#define KILN_NATIVE_LAUNCH_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef int (*launch_kernel_fn)(void *function, unsigned gx, unsigned gy, unsigned gz,
                                unsigned bx, unsigned by, unsigned bz, unsigned shared_bytes,
                                void *stream, void **params, void **extra);
typedef int (*launch_kernel_ex_fn)(const void *config, void *function, void **params,
                                   void **extra);
typedef int (*context_fn)(void *context);
typedef int (*pop_context_fn)(void **context);

/* CUlaunchConfig (cuda.h). */
typedef struct {
    uint32_t grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
    void *stream;
    void *attrs;
    uint32_t num_attrs;
} launch_config;

typedef struct {
    void *function;                 /* CUfunction, loaded once per specialisation */
    launch_kernel_fn launch;        /* cuLaunchKernel */
    launch_kernel_ex_fn launch_ex;  /* cuLaunchKernelEx, used when config is set */
    context_fn set_current;         /* cuCtxSetCurrent */
    context_fn push_current;        /* cuCtxPushCurrent */
    pop_context_fn pop_current;     /* cuCtxPopCurrent */
    void *context;                  /* the primary context the module was loaded in */
    launch_config *config;          /* cluster / programmatic launch attributes, or NULL */
    uint64_t *words;                /* flat arguments, then grid x y z, shared bytes, stream */
    void **params;                  /* &words[i] for each kernel parameter */
    const int32_t *pointer_slots;   /* launch_pointers: slot per address, ~slot: one word */
    uint32_t pointer_count;
    uint32_t grid_slot;
    uint32_t block[3];
    uint32_t plain_fallback;        /* programmatic: plain launch when the attribute is refused */
    /* launch_mapped: per address position, MEMO_WAYS (tensor address, descriptor address)
     * pairs, valid while the descriptor cache's eviction count equals memo_evictions. */
    uint64_t *map_memo;
    const uint64_t *evictions;
    uint64_t memo_evictions;
} launch_record;

enum { MEMO_WAYS = 16 };
enum { MAX_POINTERS = 128 };  /* addresses of one bound launch */

/* A tensor address's way in its position's memo (allocations are 512-byte aligned). */
static inline uint64_t *memo_entry(launch_record *r, Py_ssize_t position, uint64_t address)
{
    uint64_t way = ((address >> 9) ^ (address >> 21)) & (MEMO_WAYS - 1);
    return r->map_memo + 2 * ((uint64_t)position * MEMO_WAYS + way);
}

/* Shared between the two sources, not exported from the module. */
#define KILN_INTERNAL __attribute__((visibility("hidden")))

enum { GUARD_VALUE = 0, GUARD_TENSOR = 1, GUARD_CHECKED = 2 };  /* guard_values' entry kinds */
enum { CALL_VALUE = 0, CALL_TENSOR = 1, CALL_NONE = 2 };  /* call_plan's entry kinds */
enum { CALL_CONST = 0, CALL_INPUT = 1, CALL_OUTPUT = 2, CALL_SPACE = 3 };  /* its item kinds */

/* A torch tensor's metadata as the torch bridge (native_torch.cpp, its View) reads it. */
typedef struct {
    uint64_t data;
    const int64_t *sizes;
    const int64_t *strides;
    int64_t ndim;
    int32_t scalar_type;  /* c10::ScalarType */
    int32_t device_type;  /* c10::DeviceType: 1 is CUDA */
} torch_view;

/* The bridge's reader (set_torch_view): 1 with the view of a plain strided torch tensor, 0 for
 * anything else; NULL until the bridge is loaded. */
typedef int (*torch_view_fn)(PyObject *object, torch_view *view);
KILN_INTERNAL extern torch_view_fn read_torch_view;

KILN_INTERNAL launch_record *record_of(PyObject *address);
KILN_INTERNAL int launch_in_context(launch_record *r);
KILN_INTERNAL PyObject *finish(int code);
KILN_INTERNAL int stream_of(PyObject *stream, uint64_t *handle);
KILN_INTERNAL int address_of(PyObject *item, uint64_t *value);
KILN_INTERNAL PyObject *make_outputs(PyObject *outputs, PyObject *stream);
KILN_INTERNAL PyObject *launch_values(launch_record *r, PyObject *fallback, PyObject *stream,
                                      const uint64_t *values, uint64_t handle);
KILN_INTERNAL PyObject *call_plan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
KILN_INTERNAL int call_plan_init(void);  /* the CallPlan type; 0 on success */
KILN_INTERNAL PyObject *launch_guarded(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
KILN_INTERNAL PyObject *guard_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
KILN_INTERNAL int guard_init(void);  /* the attribute names the guards read; 0 on success */

#endif
