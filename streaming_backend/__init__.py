"""The pure core of the streaming token server: loading, sampling, detokenising, the engine.

Nothing here imports Triton, tritonclient or websockets; the Triton model and the bridge are
adapters. Import from the submodules (`streaming_backend.engine`, ...): this file stays empty so
that light users such as the launcher do not pay for importing torch.
"""
