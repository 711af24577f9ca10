"""The client layer: one request type in, one Chunk type out, whatever the transport.

request.py        GenerateRequest and its inputs by wire tensor name
chunk.py          Chunk, the one client-side type of a model response; GenerationError
grpc_client.py    tritonclient gRPC streams -> Chunks
sse_client.py     Triton's HTTP generate_stream (server-sent events) -> Chunks
openai_client.py  an OpenAI-compatible streaming API -> Chunks
targets.py        gRPC targets naming one or several replicas; failover.py: retry on another
replica_health.py readiness of each replica a target names
metrics.py        the one definition of TTFT, ITL, percentiles and the throughput span
aio.py            a time limit on one await

It imports nothing of the rest of clients/, and of streaming_backend/ only the wire contract and
the request keys (tests/test_layout.py).
"""
