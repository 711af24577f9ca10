"""The dialogue model's own code: token ids in and out on Triton's batches, and beam search.

`convert`: a request's input arrays -> `DialogueRequest`, a result -> output arrays.
`generation`: a batch of requests on the chat model's steps (`Generator`), one forward pass per
step for every row; a request is one row (sampling) or W rows (beams, `beam`).
"""
