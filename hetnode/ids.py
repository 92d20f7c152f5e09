"""Distinct id types, so that a type checker stops a session id being passed where a node id belongs."""

from typing import NewType

# The base58 libp2p peer id ("12D3Koo..."); the in-memory transport uses any unique string.
NodeId = NewType("NodeId", str)
SessionId = NewType("SessionId", str)
ProtocolId = NewType("ProtocolId", str)
