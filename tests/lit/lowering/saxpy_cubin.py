# REQUIRES: ptxas
# RUN: %python %S/Inputs/print_stages.py sm_90a sm_80 | FileCheck %s

# With ptxas the cubin stage exists and ptxas -v fills in the resource counts.
# CHECK-LABEL: // STAGE sm_90a cubin
# CHECK-NEXT: <{{[0-9]+}} bytes>
# CHECK: // METADATA sm_90a num_warps=4 registers={{[1-9][0-9]*}} shared_bytes=0 spill_bytes=0 stack_bytes=0
# CHECK-LABEL: // STAGE sm_80 ptx
# CHECK: .target sm_80
# CHECK-LABEL: // STAGE sm_80 cubin
# CHECK: // METADATA sm_80 num_warps=4 registers={{[1-9][0-9]*}}
