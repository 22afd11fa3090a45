"""TMA descriptors for launches recorded into a CUDA graph.

Outside a capture a new descriptor gets its own ``cuMemAlloc`` and a synchronous copy
(:class:`~kiln.runtime.tensor_maps.TensorMapCache`). Inside one both are refused (the capture is
invalidated), which is what made a GEMM whose output is allocated inside the capture
uncapturable. A :class:`CaptureArena` is allocated beforehand, with the cache's first
descriptor: page-locked host slots and device slots of 128 bytes. A descriptor first needed
inside a capture is written to a host slot and copied to its device slot with
``cuMemcpyHtoDAsync`` on the capturing stream, so the graph holds the copy and every replay
rewrites the descriptor before the kernel that reads it. A slot is never reused: a graph may
replay its copy at any later time.

Example::

    arena = CaptureArena(driver(), slots=64)
    address = arena.put(encoded_descriptor, stream)   # inside torch.cuda.graph(...)
"""

from __future__ import annotations

import ctypes
import weakref

from kiln.core.errors import LaunchError

DESCRIPTOR_BYTES = 128  # sizeof(CUtensorMap); cuMemAlloc and cuMemHostAlloc align to more


class CaptureArena:
    """``slots`` descriptor slots in page-locked host memory and in device memory, handed out
    once each by :meth:`put`; both blocks are freed when the arena is collected."""

    def __init__(self, driver, slots: int):
        self._driver = driver
        self.slots = slots
        self._used = 0
        self._device = driver.mem_alloc(slots * DESCRIPTOR_BYTES)
        self._host = driver.mem_alloc_host(slots * DESCRIPTOR_BYTES)
        weakref.finalize(self, _free, driver, self._device, self._host)

    def __len__(self) -> int:
        return self._used

    def put(self, encoded: bytes, stream: int) -> int:
        """The device address of a fresh slot that ``stream`` fills with ``encoded`` (the copy
        is recorded into the graph being captured on it)."""
        if self._used == self.slots:
            raise LaunchError(f"more than {self.slots} TMA descriptors of one kernel were first "
                              "needed inside CUDA-graph captures",
                              fix="launch once outside the capture on the tensors the captured "
                                  "launches use, or capture fewer distinct tensors per kernel")
        offset = self._used * DESCRIPTOR_BYTES
        self._used += 1
        ctypes.memmove(self._host + offset, encoded, DESCRIPTOR_BYTES)
        self._driver.memcpy_htod_async(self._device + offset, self._host + offset,
                                       DESCRIPTOR_BYTES, stream)
        return self._device + offset


def _free(driver, device: int, host: int) -> None:
    """Free both blocks (at collection or interpreter exit, so errors of a driver that is
    already shutting down are ignored)."""
    try:
        driver.mem_free(device)
        driver.mem_free_host(host)
    except LaunchError:
        pass
