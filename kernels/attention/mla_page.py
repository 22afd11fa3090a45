"""The pieces of one MLA decode page that every schedule of the kernel shares
(:mod:`.mla_kernel`'s split keys, :mod:`.mla_lead`, :mod:`.mla_seesaw`, :mod:`.mla_balanced`):
the tile sizes, a page's TMA load into the ring, ``S = Q K^T`` of a page and its streaming
softmax, and the zeroing of V's rows past the sequence.

Example: ``scores = page_scores(descs, units)`` then
``m, l, p, alphas = page_softmax(scores, m, l, key0, tid, key_limit, scale_log2, False)``.
"""

from __future__ import annotations

import kiln
from kiln import tma, wgmma

from .decode_wgmma import tile_softmax
from .paged import PagedRowIndices

HEAD_DIM = 576  # the latent KV head: 512 V columns and 64 rotary columns
HEAD_DIM_V = 512
BLOCK_N = 64  # keys per tile: one page
ROWS = 64  # packed query rows per CTA: one wgmma M
CHUNK = 64  # columns per 128-byte swizzled TMA box
CHUNKS = HEAD_DIM // CHUNK
V_CHUNKS = HEAD_DIM_V // CHUNK
STAGES = 2
WARP_GROUPS = 2
THREADS = 128 * WARP_GROUPS
NUM_WARPS = THREADS // 32
GROUP_COLS = HEAD_DIM_V // WARP_GROUPS  # O columns of one warp group
BOX_BYTES = BLOCK_N * CHUNK * 2
TILE_BYTES = CHUNKS * BOX_BYTES
BOX_UNITS = BOX_BYTES // 16  # one box in 16-byte descriptor units


@kiln.func
def page_scores(descs, units):
    """``S = Q K^T`` of the page ``units`` descriptor units into the ring (``m64n64k16`` x 36;
    ``descs``: Q's and K's descriptors first), committed, not waited."""
    scores = wgmma.fragment_zeros(BLOCK_N)
    wgmma.fence()
    for ks in kiln.static_range(HEAD_DIM // 16):
        offset = (ks // 4) * BOX_UNITS + (ks % 4) * 2  # 16 columns = 32 bytes of a box
        scores = wgmma.mma_async(scores, descs[0] + offset, descs[1] + units + offset,
                                 dtype=kiln.bf16)
    wgmma.commit()
    return scores


@kiln.func
def page_softmax(scores, m, l, key0, tid, key_limit, scale_log2, masked):
    """The streaming softmax of one ``64 x 64`` score tile (each row a thread quad's):
    new ``(m, l)`` (base 2; ``l`` per lane until the end), P as bf16 A operands, and the
    factors O is rescaled by. ``masked``: keys past each row's ``key_limit`` are -inf."""
    return tile_softmax(scores, m, l, key0, tid, key_limit, scale_log2, BLOCK_N, masked)


@kiln.func
def load_tile(page_size, table, tile, seq_len, kv_map, boxes, full, stage, producer, arm,
              slot=None):
    """TMA page ``tile``'s ``64 x 576`` rows into ring ``stage`` as nine column boxes
    (``arm``: this call expects the tile's bytes on ``full``; the first page's are expected
    together with Q's). They land on ``full``'s barrier ``slot``: ``stage`` by default; a
    ring of single-slot barriers (:mod:`.mla_seesaw`) passes ``full[stage]`` and 0."""
    slot = stage if slot is None else slot
    if arm:
        full.arrive_expect_tx(slot, TILE_BYTES, predicate=producer)
    row = PagedRowIndices[BLOCK_N, page_size].populate(table, tile * BLOCK_N, seq_len).row(0)
    for c in kiln.static_range(CHUNKS):
        tma.load(kv_map, boxes.tile(CHUNKS * (1 + stage) + c), (c * CHUNK, row), full, slot,
                 predicate=producer)


@kiln.func
def zero_v(boxes, box, valid_keys, lane, threads):
    """Zero the 128-byte rows of V's eight column boxes from key ``valid_keys`` on: ``0 * NaN``
    in ``P V`` would poison a row (a whole row is zeroed, so the swizzle does not matter).
    ``box``: the box of V's first chunk (chunk ``c`` in ``box + c``), or a function giving
    chunk ``c``'s box beside each store. ``threads`` threads share the 16-byte stores, ``lane``
    (``0 .. threads - 1``) this thread's place among them."""
    zeros = kiln.vector_constant([0.0] * 8, kiln.bf16)
    units = V_CHUNKS * BLOCK_N * 8  # 16-byte units of V
    for step in kiln.static_range(units // threads):
        index = step * threads + lane
        key = index // 8 % BLOCK_N
        if key >= valid_keys:
            boxes.store(box(index // (8 * BLOCK_N)) if callable(box) else
                        box + index // (8 * BLOCK_N), key, index % 8 * 8, zeros, align=16)
