"""A request's sampling: its keys and settings, and how a next token is chosen from the logits.

`request_keys`: the one table of request keys (type, default, range, OpenAI name, models).
`settings`: `SamplingSettings`, built from that table, and the request's parsing and checks.
`logits`: `NextTokenChooser`, the logits pipeline both models run (penalties, temperature,
top-k/top-p/min-p, masks, a seeded draw). `sampling`: its building blocks. `grammar`: guided
decoding's token masks. `stopping`: stop strings over the detokenised text. `logprobs`: the
chosen and top tokens' log-probabilities.
"""
