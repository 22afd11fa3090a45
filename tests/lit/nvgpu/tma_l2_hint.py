# RUN: %python %s | FileCheck %s
# kiln.tma.load(..., eviction_policy=...) through the sm_90a stages: the hinted copy carries
# its createpolicy operand from the nvvm stage on; the plain copy next to it has none.

import os

os.environ["KILN_PTXAS"] = "none"  # stop at PTX: the checks must not depend on ptxas
os.environ["KILN_NO_CACHE"] = "1"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import kiln  # noqa: E402
from kiln import mbarrier, tma  # noqa: E402
from kiln.nvidia.sync import fence_mbarrier_init  # noqa: E402

BOX = (64, 64)


@kiln.kernel
def streamed_sum(once_map: kiln.TensorMap[kiln.bf16, BOX, 128],
                 reused_map: kiln.TensorMap[kiln.bf16, BOX, 128], out: kiln.Tensor[kiln.f32]):
    once = kiln.shared(BOX, kiln.bf16, align=1024)
    reused = kiln.shared(BOX, kiln.bf16, align=1024)
    leader = kiln.thread_id(0) == 0
    bars = mbarrier.group(num_barriers=1)
    bars.init(0, count=1, predicate=leader)
    fence_mbarrier_init()
    kiln.barrier()
    bars.arrive_expect_tx(0, 2 * tma.box_bytes(once_map), predicate=leader)
    tma.load(once_map, once, (0, 0), bars, 0, predicate=leader, eviction_policy="evict_first")
    tma.load(reused_map, reused, (0, 0), bars, 0, predicate=leader)
    bars.try_wait(0, phase=0)
    if leader:
        out[0] = kiln.cast(once[0, 0], kiln.f32) + kiln.cast(reused[0, 0], kiln.f32)


tile = np.ones(BOX, ml_dtypes.bfloat16)
compiled = streamed_sum.compile(tile, tile, np.zeros(1, np.float32), target="sm_90a")
for stage in ("nvvm", "ptx"):
    print(f"// STAGE {stage}")
    print(compiled.asm[stage])

# CHECK-LABEL: // STAGE nvvm
# CHECK: %[[POLICY:.*]] = llvm.inline_asm {kiln.op = "nvidia.sync.l2_cache_policy"} "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l"
# CHECK-NEXT: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [$0], [$1, {$2,$3} ], [$4], $5;"{{.*}}, %[[POLICY]],
# CHECK-NOT: cache_hint
# CHECK: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1, {$2,$3} ], [$4];"

# CHECK-LABEL: // STAGE ptx
# CHECK: createpolicy.fractional.L2::evict_first.b64 [[POLICY:%rd[0-9]+]], 1.0;
# CHECK: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [{{.*}}], [{{.*}}], [{{.*}}], [[POLICY]];
# CHECK-NOT: cache_hint
# CHECK: cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [{{.*}}], [{{.*}}], [{{.*}}];
