"""Resource usage reported by the vendor tools: ``ptxas -v`` text and AMD code-object metadata.

Example::

    >>> parse_ptxas_verbose(
    ...     "ptxas info    : Function properties for saxpy\\n"
    ...     "    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\\n"
    ...     "ptxas info    : Used 12 registers, 1024 bytes smem, 380 bytes cmem[0]\\n", "saxpy")
    {'registers': 12, 'spill_bytes': 12, 'shared_bytes': 1024, 'stack_bytes': 0, 'wgmma_serialized': None}
"""

from __future__ import annotations

import re

# wgmma_serialized: why ptxas serialised the kernel's WGMMAs (each waits for the one before:
# a silent slowdown, e.g. when registers a WGMMA reads are written while an earlier group is in
# flight), or None.
NVIDIA_KEYS = ("registers", "spill_bytes", "shared_bytes", "stack_bytes", "wgmma_serialized")
AMD_KEYS = {  # metadata key -> code-object note field
    "vgpr_count": ".vgpr_count",
    "agpr_count": ".agpr_count",
    "sgpr_count": ".sgpr_count",
    "scratch_bytes": ".private_segment_fixed_size",
    "lds_bytes": ".group_segment_fixed_size",
}

_ENTRY = re.compile(r"ptxas info\s*: (?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized due to (.+?) in the "
                         r"function '([\w$.]+)'")


def empty_nvidia_metadata() -> dict:
    """NVIDIA resource keys with None values (no ``ptxas`` to ask)."""
    return dict.fromkeys(NVIDIA_KEYS)


def parse_ptxas_verbose(text: str, kernel: str) -> dict:
    """Registers, spill bytes (stores + loads), shared and stack bytes of ``kernel``, and the
    reason ptxas gives when it serialised the kernel's WGMMAs.

    ``text`` is the stderr of ``ptxas -v``; lines about other functions are ignored. Keys
    whose line is missing stay None.
    """
    result = empty_nvidia_metadata()
    current = None
    for line in text.splitlines():
        serialized = _SERIALIZED.search(line)
        if serialized and serialized.group(2) == kernel:
            result["wgmma_serialized"] = serialized.group(1)
        entry = _ENTRY.search(line)
        if entry:
            current = entry.group(1)
            continue
        if current != kernel:
            continue
        frame = _FRAME.search(line)
        if frame:
            result["stack_bytes"] = int(frame.group(1))
            result["spill_bytes"] = int(frame.group(2)) + int(frame.group(3))
        used = _USED.search(line)
        if used:
            result["registers"] = int(used.group(1))
            smem = _SMEM.search(line)
            result["shared_bytes"] = int(smem.group(1)) if smem else 0
    return result


def parse_amd_notes(text: str, kernel: str) -> dict:
    """VGPR/AGPR/SGPR counts, scratch and LDS bytes of ``kernel`` from the ``amdhsa.kernels``
    YAML: the assembly's ``.amdgpu_metadata`` block, or ``llvm-readelf --notes`` of an object.

    The notes hold an ``amdhsa.kernels`` YAML list; each kernel's own fields sit at one
    indentation (its ``.args`` entries, which also have ``.name``, sit deeper).
    """
    result = dict.fromkeys(AMD_KEYS)
    for fields in _amd_kernel_entries(text):
        if fields.get(".name") == kernel:
            for key, field in AMD_KEYS.items():
                if field in fields:
                    result[key] = int(fields[field])
    return result


_NOTE_FIELD = re.compile(r"^(\s*)(- )?(\.[\w.]+):\s*(.*?)\s*$")


def _amd_kernel_entries(text: str) -> list[dict[str, str]]:
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "amdhsa.kernels:")
    except StopIteration:
        return []
    entries: list[dict[str, str]] = []
    item_indent = None
    for line in lines[start + 1:]:
        match = _NOTE_FIELD.match(line)
        if not match:
            if line.strip() and not line.startswith(" "):
                break  # the next top-level key ends the kernel list
            continue
        indent, dash, field, value = match.groups()
        if dash and (item_indent is None or len(indent) == item_indent):
            item_indent = len(indent)
            entries.append({})
        if entries and len(indent) + (2 if dash else 0) == item_indent + 2:
            entries[-1][field] = value.strip("'\"")
    return entries
