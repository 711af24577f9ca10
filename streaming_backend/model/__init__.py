"""The loaded model and the memory around it.

`loading`: a Hugging Face folder, a GGUF file or a hub id -> `LoadedModel` (dtype, context,
EOS ids). `hardware`: what the device and CPU can do and the dtype and weight format `auto`
picks from it. `kvcache` and `prefix_cache`: the KV cache's budget and the reuse of earlier
prompts' keys and values. `numerics`: the facts that decide the model's numbers and their
system fingerprint.
"""
