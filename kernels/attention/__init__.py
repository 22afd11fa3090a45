"""Attention kernels: online softmax, prefill, paged decode, split-KV combine."""
