"""The Triton adapter of both models: wire tensors <-> the core's types, and the threads and calls
around them, as plain Python and numpy.

`inputs.py` copies a request's tensors out of Triton (both models); `request.py` turns the
chat model's input arrays into a ModelRequest; `response.py` turns token events into output
arrays; `outbox.py` is the one thread that answers requests, through `sender.py`; `control.py`
takes the supervisor's canary and drain; `metrics.py` keeps our metric families; `dialogue.py`
holds the dialogue model's converters. The pb_utils module is importable only inside Triton's
stub, so the models' model.py pass it in (or the one class of it a module needs), and
everything here is tested without a server.
"""
