"""Pure policies that the runtime and the simulator both execute: one decision, written once.

No torch, no trio, no I/O, no clock: a policy is an object that takes plain records and returns a decision,
and each executor (the node's batch loop, the simulated node) turns the decision into work.
"""

from hetnode.policy.batching import MIN_CHUNK, PREEMPTED, BatchConfig, BatchPolicy, Pending, Step
from hetnode.policy.kv_codec import REPREFILL, CodecOption, KVCodecChoice, KVCodecPolicy, LinkEstimate
from hetnode.policy.kv_ledger import KVLedger
from hetnode.policy.kv_transfer import KVTransferChoice, KVTransferPolicy
from hetnode.policy.lifecycle import CAUSES, Cause, Lifecycle, Next, Restart
from hetnode.policy.step_rate import StepRate

__all__ = [
    "CAUSES", "MIN_CHUNK", "PREEMPTED", "REPREFILL", "BatchConfig", "BatchPolicy", "Cause", "CodecOption",
    "KVCodecChoice", "KVCodecPolicy", "KVLedger", "KVTransferChoice", "KVTransferPolicy", "Lifecycle",
    "LinkEstimate", "Next", "Pending", "Restart", "Step", "StepRate",
]
