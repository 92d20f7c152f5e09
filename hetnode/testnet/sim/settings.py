"""Named settings of the simulator: `hetnode sim --like NAME` is these `SimOptions` fields, nothing more.

- "hetnode" (the default): the runtime's own behaviour, the settings that predict the testnet best
  (scripts/validate_sim.py): KV as memory minus weights (or the pool a cluster file or the testnet gives), a
  token budget per step with prompts chunked to it, the backlog offline loop, one message per step and hop.
- "helix": what Helix's public simulator does (its artifact, read side by side; issue 13), for reproducing
  figures that came from it: each node's KV pool as vLLM allocated it and its per-step caps
  (`vllm_capacity.csv`, `step_caps`; past the table's layer counts, the table's line and its last caps, as Helix
  gave its separate pipelines: `past_table`), whole prompts (no token budget to chunk them: the caps bound a
  step), its offline loop (20 requests, then one at each prompt's end and each request's end while the estimated KV
  use of the fullest layer is <= 0.8), its KV high-water marks and output-length ratios (0.85 and 1.0
  offline, 0.9 and 0.6 online) on a fixed expected output of 240 tokens (it does not learn from the outputs
  that end), one message per item on a link, each decode token back to the first hop by way of the coordinator
  (its query manager issues every decode iteration anew from its source: two coordinator links' latencies a
  token, where the runtime's last hop feeds the first straight), SWARM's scheduler drawing each next hop by the
  time requests recently took over that link and its step (Helix's `SwarmNode.ema`; the runtime's draws by the
  node's rate alone), and its costs outside the layer tables (a
  one-item decode step twice the table's, 7.4 us per token to copy a step's input in at layer 0).
  Its offline loop is Helix's feeder (`OfflineRequestFeeder`): each request's lengths drawn at random from the
  whole trace (`OfflineLoop.lengths="drawn"`), the first 20 issued 0.1 s apart and each later one 0.1 s after
  the prompt's end or request's end that adds it (`delay_s=0.1`). The two belong together: drawn lengths alone
  put throughput at 0.91-0.95x and the decode step p50 at 1.13-1.16x Helix's; with the delay 9, 8 and 9 of 9
  figures are within 5% (seeds 0, 1, 2; scripts/validate_sim_helix.py, docs/simulator.md).
  Helix's artifact runs that loop only under its own max-flow scheduler. For its Swarm, random and shortest-queue
  schedulers, which cannot refuse a request, its feeder keeps a hand-set number of requests in flight instead,
  each one that ends replaced at once, whatever the KV holds (`OfflineRequestFeeder.check_launch_new_query`:
  "we can only set a manual max query count"): `like("helix", offline=True, inflight=N)` is that feeder
  (`OfflineLoop(every="replace")`, its lengths and delays the same), for the runs where the artifact set N.
  Two more costs read in the artifact are fields but not in "helix" (`solo_beside_prompts`, `copy_every_node`:
  Helix doubles the decode part of any layer batch with one decode item and copies the input at every node's
  first layer); measured with the rest, they move the offline figures out (docs/simulator.md).

Every field is a plain `SimOptions` field that can also be set alone; `options_like(name, offline, **more)`
builds the options, later keywords winning. The batch caps and marks are the runtime's own policy settings
(`BatchConfig.max_prompts/max_decodes`, the scheduler's `high_water` and `output_ratio`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hetnode.errors import ConfigError
from hetnode.testnet.sim.offline_loop import OfflineLoop
from hetnode.testnet.sim.runner import SimOptions

LIKES = ("hetnode", "helix")
WHOLE_PROMPTS = 1 << 30  # a token budget no step reaches: prompts run whole, the step caps bound a step

_HELIX: dict[str, Any] = {
    "kv_pool": "measured",
    "past_table": "line",
    "step_caps": True,
    "max_batch_tokens": WHOLE_PROMPTS,
    "link_messages": "item",
    "decode_loop": "coordinator",
    "swarm_wiring": "link",
    "solo_decode_factor": 2.0,
    "first_layer_copy_s": 7.4e-6,
    "output_len": 240.0,
    "learn_output": False,
}
_HELIX_OFFLINE: dict[str, Any] = {"high_water": 0.85, "output_ratio": 1.0,
                                  "offline_loop": OfflineLoop(every="prompt_or_end", measure="layer", lengths="drawn",
                                                              delay_s=0.1)}
_HELIX_ONLINE: dict[str, Any] = {"high_water": 0.9, "output_ratio": 0.6}


def like(name: str, *, offline: bool, inflight: int | None = None) -> dict[str, Any]:
    """The `SimOptions` fields that setting `name` sets, for an offline or an online run; `inflight` (helix,
    offline): the hand-set count Helix's feeder keeps in flight for a scheduler that cannot refuse a request."""
    if name == "hetnode":
        if inflight is not None:
            raise ConfigError("a hand-set count in flight is Helix's feeder's: a setting of --like helix",
                              key="inflight")
        return {}
    if name == "helix":
        fields = {**_HELIX, **(_HELIX_OFFLINE if offline else _HELIX_ONLINE)}
        if inflight is not None and offline:
            fields["offline_loop"] = replace(fields["offline_loop"], start=inflight, every="replace")
        return fields
    raise ConfigError(f"unknown simulator setting {name!r}; known: {', '.join(LIKES)}", key="--like")


def options_like(name: str, *, offline: bool, inflight: int | None = None, **more: Any) -> SimOptions:
    """SimOptions of setting `name`, with the fields in `more` set on top (None in `more`: the setting's)."""
    fields: Mapping[str, Any] = {**like(name, offline=offline, inflight=inflight),
                                 **{k: v for k, v in more.items() if v is not None}}
    try:
        return SimOptions(**fields)
    except TypeError as exc:
        raise ConfigError(f"bad simulator option: {exc}") from exc
