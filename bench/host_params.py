"""The driver's share of a launch by parameter count, on the GPU machine (issue 42): the
``params`` part of ``bench/host_variants.py``.

A one-block kernel's launch (6 flat arguments) against ``decode_attention``'s (about 105),
each through the shim's ``launch_on`` with ready addresses; then ``decode_attention``'s kernel
by ctypes ``cuLaunchKernel(Ex)`` with a pointer per parameter (what the shim passes) against
one packed parameter buffer (``extra``, laid out by ``cuFuncGetParamInfo``).

Usage: ``python bench/host_variants.py --only params``.
"""

from __future__ import annotations

import sys

sys.path.insert(0, "bench")
from host_breakdown import _closure, per_call_us  # noqa: E402


def timed(call, calls=2000, batches=7, sync=None) -> float:
    return per_call_us(call, calls, batches, sync)


def param_rows(torch) -> dict:
    """The driver's share of a launch by parameter count: a one-block kernel with 6 flat
    arguments and decode_attention's (about 120), each through the shim's launch_on with
    ready addresses; then decode_attention's kernel by ctypes cuLaunchKernel(Ex) with the
    per-parameter pointers (what the shim passes) against one packed parameter buffer
    (``extra``, laid out by cuFuncGetParamInfo)."""
    import ctypes

    from launch_overhead import N, add_one, library_calls

    from kiln.kernels.attention import decode_plan
    from kiln.runtime.launch import bind_launch

    rows: dict = {}
    raw = torch._C._cuda_getCurrentRawStream
    y = torch.zeros(N, device="cuda")
    tiny = bind_launch(add_one.compile(y, N, BLOCK=N, num_warps=N // 32, target="sm_90a"),
                       (1, 1, 1), [y, N])
    pointer = y.data_ptr()
    rows["tiny kernel launch_on (6 flat args)"] = timed(lambda: tiny.launch_on(raw(-1), pointer))
    call = library_calls(torch, "cuda", "sm_90a")["decode_attention (same)"]
    call()
    guard, plan = decode_plan.PLANS.last
    q, k_cache, v_cache, table, lens = _closure(call)["paged"]
    stream = raw(-1)
    owners, (p0, p1, p2, tickets) = plan.spaces.get(stream)
    kept = plan.torch_outputs()
    ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(),
            lens.data_ptr(), *plan.placeholder_pointers, p0, p1, p2, kept[0].data_ptr(),
            kept[1].data_ptr(), tickets)
    bound = plan.bound
    sync = torch.cuda.synchronize
    # 100 launches a sample, synchronised between samples: fewer than the launch queue holds,
    # so the host's time is measured, not the GPU's (about 17 µs a launch here).
    rows["decode_attention launch_on (ready addresses)"] = timed(
        lambda: bound.launch_on(stream, *ptrs), 100, 9, sync)
    bound.launch_on(stream, *ptrs)  # the words now hold live addresses
    torch.cuda.synchronize()
    arguments, launcher = bound._arguments, bound._launcher
    count = launcher.grid_slot
    rows["decode_attention flat params"] = count
    cuda = ctypes.CDLL("libcuda.so.1")
    info = cuda.cuFuncGetParamInfo
    info.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                     ctypes.POINTER(ctypes.c_size_t)]
    layout = []
    for i in range(count):
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        if info(launcher.function, i, ctypes.byref(offset), ctypes.byref(size)):
            raise RuntimeError("cuFuncGetParamInfo failed")
        layout.append((offset.value, size.value))
    total = max(o + z for o, z in layout)
    buffer = (ctypes.c_uint8 * total)()
    words = arguments.words
    for i, (offset, size) in enumerate(layout):
        ctypes.memmove(ctypes.addressof(buffer) + offset, ctypes.addressof(words) + 8 * i, size)
    size_value = ctypes.c_size_t(total)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(size_value),
                                  0)
    functions, slot = launcher.functions, launcher.grid_slot
    grid, smem = list(words[slot:slot + 3]), words[slot + 3] & 0xFFFFFFFF
    params = ctypes.addressof(arguments._params)
    config = arguments._config
    if config is not None:
        config.grid_x, config.grid_y, config.grid_z = grid
        config.shared_bytes, config.stream = smem, stream or None
        address = ctypes.addressof(config)
        by_params = lambda: functions.launch_ex(address, launcher.function, params, None)  # noqa
        by_buffer = lambda: functions.launch_ex(address, launcher.function, None,  # noqa
                                                ctypes.addressof(extra))
    else:
        block = launcher.signature.block
        by_params = lambda: functions.launch(launcher.function, *grid, *block, smem,  # noqa
                                             stream or None, params, None)
        by_buffer = lambda: functions.launch(launcher.function, *grid, *block, smem,  # noqa
                                             stream or None, None, ctypes.addressof(extra))
    for label, launch in (("ctypes, kernelParams", by_params), ("ctypes, packed extra", by_buffer),
                          ("ctypes, kernelParams (again)", by_params)):
        code = launch()
        rows[f"decode_attention {label}"] = timed(launch, 100, 9, sync) if code == 0 else \
            f"CUresult {code}"
    torch.cuda.synchronize()
    rows["param bytes"] = total
    for name, value in rows.items():
        print(f"  {name:<56}{value}", flush=True)
    del owners, kept
    return rows
