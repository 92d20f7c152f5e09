"""A phase-split replica's step setting by its role: how many prompt tokens a node of a prefill replica batches.

ThunderServe runs its prefill replicas for latency (§3.2: "the prefill phase is computation-intensive and
batching does not help to enhance efficiency"; Appendix B picks their latency-optimal layouts) and batches as
DistServe does (§4: it "leverages the batching strategy proposed by Zhong et al."): a prefill instance batches
prompts first come first served up to the length L_m that saturates the GPU and runs a longer prompt alone
(DistServe §4.3). ThunderServe measures that plateau at 1,024 tokens a batch (§2, Fig. 2). The planner prices
a prefill replica's latency as one prompt pipelined through its stages; a step of the runtime's whole token
budget (8,192: four coding prompts) instead holds every prompt of a wave in each stage for the wave's time
(issue 14). A decode replica keeps the shared setting: batching is where its throughput comes from.

The setting is the batch policy's `BatchConfig.prompt_tokens`. `prompt_tokens_for` is the one place that maps a
role to it; the simulator's nodes (`SimOptions.prefill_tokens`, by the plan's replicas) and a live deployment (the
coordinator's assignments name each node's cap, from its role; `hetnode join --prefill-tokens` overrides it on a
node) both ask it, so the two executors decide alike. Which cap a deployment runs by default is its placement's
(`prefill_tokens_of`): ThunderServe's, whose paper batches so; none for the others. Pure.
"""

from __future__ import annotations

PREFILL_TOKENS = 1024  # ThunderServe §2, Fig. 2: past 1,024 tokens a batch, prefill's GPU efficiency plateaus
# A plan's prefill roles. Cronus's partial-prefill instance ("ppi") is told "prefill" on the wire (the
# coordinator's `_wire_role`), so a live node cannot tell it from ThunderServe's; the simulator does as it does.
PREFILL_ROLES = frozenset({"prefill", "ppi"})
# Placements whose paper batches a prefill replica's prompts so by default (ThunderServe §4, after DistServe).
BATCHING_PREFILL = frozenset({"thunderserve"})


def prefill_tokens_of(method: str, chosen: int | str = "auto") -> int | None:
    """The prefill replicas' prompt-token cap of a deployment placed by `method`: `chosen` when it is a number
    (0: none), else (`"auto"`) PREFILL_TOKENS for a placement whose paper batches prefill so, None otherwise."""
    if chosen == "auto":
        return PREFILL_TOKENS if method in BATCHING_PREFILL else None
    if not isinstance(chosen, int) or chosen < 0:
        raise ValueError(f"prefill_tokens must be 'auto' or >= 0, not {chosen!r}")
    return chosen or None


def prompt_tokens_for(role: str | None, prefill_tokens: int | None) -> int | None:
    """The `BatchConfig.prompt_tokens` of a node of a replica of `role` (None: of no phase-split replica):
    `prefill_tokens` for a prefill role, None (no cap beyond the token budget) for any other or when
    `prefill_tokens` is None (the shared setting)."""
    if prefill_tokens is not None and prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be >= 1 or None, not {prefill_tokens}")
    return prefill_tokens if role in PREFILL_ROLES else None
