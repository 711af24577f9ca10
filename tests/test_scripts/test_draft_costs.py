"""scripts/draft_costs.py: the tokens a step with drafts gives on average."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "acceptance, draft, tokens",
    [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 2, 1.75), (0.8, 0, 1.0)],
)
def test_tokens_per_step(load_script, acceptance, draft, tokens):
    """1 + a + ... + a^draft: the verified token, then each draft while all before it held."""
    assert load_script("draft_costs").tokens_per_step(acceptance, draft) == pytest.approx(tokens)
