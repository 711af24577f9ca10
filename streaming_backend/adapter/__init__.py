"""Triton adapter helpers: wire tensors <-> the engine's types, as plain Python and numpy.

`request.py` turns a request's input arrays into a ModelRequest; `response.py` turns token events
into output arrays. repository/chat/1/model.py only moves arrays in and out of pb_utils, so
everything here is tested without a server.
"""
