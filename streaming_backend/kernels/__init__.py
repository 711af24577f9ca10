"""The C kernels as a layer of their own: the build (build.py: one table of variants, each an ISA's
flags, the CPU features it needs and its header of primitives) and the ctypes bindings, one module
per job as csrc/ has one file per job: attention, matmul (quantized and dense), the decoder stack,
the greedy pick and the thread team. They depend on nothing of ours but paths; the forward,
sampling and the model (its hardware facts, numerics and weight files) import them.
"""
