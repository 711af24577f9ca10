"""A compact forward pass for Llama-family models over a preallocated per-slot KV cache.

family.py (the families as data, the shapes), convert.py (Hugging Face weights -> ours),
layers.py (a decoder layer's math), llama.py (the forward), slots.py (the cache), runner.py
(prefill/decode entry points), compiled.py (torch.compile and CUDA graphs of the decode step),
buckets.py (step shapes).
"""
