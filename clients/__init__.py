"""Clients of the streaming token server, one subpackage per job.

library/  the client layer: requests, every transport -> one Chunk type, targets, the figures
bridge/   the websocket bridge and its chat page, the OpenAI-compatible API, its websocket client
bench/    `tokenstream bench` and `engine-bench`: TTFT, inter-token latency, throughput
stress/   `tokenstream stress`: many concurrent requests, and what operators watch
cli/      the `tokenstream` command, and the server operations it runs (serve, reload), chat
"""
