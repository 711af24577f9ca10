"""The dialogue model's own code: token ids in and out on Triton's batches, and beam search.

`convert`: a request's input arrays -> `DialogueRequest`, a result -> output arrays.
`generation`: a batch of requests generated together (`generate_batch`), one forward pass per
step for every row; a request is one row (sampling) or W rows (beams, `beam`).
`batch_forward`: the forwards those rows run on (the compact one's slots or Hugging Face's cache).
"""
