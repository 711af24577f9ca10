"""A compact forward pass for Llama-family models over a preallocated per-slot KV cache.

llama.py (the forward), slots.py (the cache), runner.py (prefill/decode entry points),
compiled.py (torch.compile and CUDA graphs of the decode step), buckets.py (step shapes).
"""
