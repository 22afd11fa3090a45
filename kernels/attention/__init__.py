"""Attention kernels: online softmax, prefill, paged decode, MLA decode, split-KV combine."""
from .decode import decode, decode_attention
from .mla_decode import compile_mla_decode, mla_decode
from .paged import PagedRowIndices, kv_sub_tile_rows
from .combine import combine, compile_combine
from .online_softmax import OnlineSoftmax
from .partials import Partials, PartialsMismatchError, fake_to_real, real_to_fake
from .prefill_gfx950 import compile_prefill_gfx950, run_prefill_gfx950
from .prefill_gfx950_fp8 import compile_prefill_gfx950_fp8, run_prefill_gfx950_fp8
from .prefill import compile_prefill, prefill
