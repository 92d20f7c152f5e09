"""A replica's role -> its step setting (role_batching.py): only prefill roles get the prompt-token cap."""

from __future__ import annotations

import pytest

from hetnode.policy.role_batching import PREFILL_TOKENS, prefill_tokens_of, prompt_tokens_for


def test_only_a_prefill_role_gets_the_cap() -> None:
    assert prompt_tokens_for("prefill", PREFILL_TOKENS) == 1024
    assert prompt_tokens_for("ppi", 512) == 512  # Cronus's partial prefill: "prefill" on the wire
    for role in ("decode", "cpi", "mixed", "idle", None):
        assert prompt_tokens_for(role, PREFILL_TOKENS) is None


def test_no_setting_is_the_shared_policy_and_a_cap_must_be_positive() -> None:
    assert prompt_tokens_for("prefill", None) is None
    with pytest.raises(ValueError, match="prefill_tokens"):
        prompt_tokens_for("prefill", 0)


def test_a_deployment_runs_its_placements_cap_unless_told_otherwise() -> None:
    assert prefill_tokens_of("thunderserve") == PREFILL_TOKENS  # ThunderServe batches prefill as DistServe does
    for method in ("helix", "split", "cronus", "ecoserve"):
        assert prefill_tokens_of(method) is None
    assert prefill_tokens_of("split", 512) == 512 and prefill_tokens_of("thunderserve", 0) is None
    with pytest.raises(ValueError, match="prefill_tokens"):
        prefill_tokens_of("thunderserve", -1)
