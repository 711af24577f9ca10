"""The Triton adapter of the chat model: wire tensors <-> the engine's types, and the threads and
calls around them, as plain Python and numpy.

`request.py` turns a request's input arrays into a ModelRequest; `response.py` turns token events
into output arrays; `outbox.py` is the one thread that answers requests, through `sender.py`;
`control.py` takes the supervisor's canary and drain; `metrics.py` keeps our metric families.
The pb_utils module is importable only inside Triton's stub, so repository/chat/1/model.py passes
it in (or the one class of it a module needs), and everything here is tested without a server.
"""
