"""A replica's role -> its step setting (role_batching.py): only prefill roles get the prompt-token cap."""

from __future__ import annotations

import pytest

from hetnode.policy.role_batching import PREFILL_TOKENS, prompt_tokens_for


def test_only_a_prefill_role_gets_the_cap() -> None:
    assert prompt_tokens_for("prefill", PREFILL_TOKENS) == 1024
    assert prompt_tokens_for("ppi", 512) == 512  # Cronus's partial prefill: "prefill" on the wire
    for role in ("decode", "cpi", "mixed", "idle", None):
        assert prompt_tokens_for(role, PREFILL_TOKENS) is None


def test_no_setting_is_the_shared_policy_and_a_cap_must_be_positive() -> None:
    assert prompt_tokens_for("prefill", None) is None
    with pytest.raises(ValueError, match="prefill_tokens"):
        prompt_tokens_for("prefill", 0)
