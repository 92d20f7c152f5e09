"""What a coordinator keeps across restarts: `hetnode coordinator --state-dir DIR`.

A coordinator that comes back must be the same peer at the same addresses, or its nodes cannot find it (they
rejoin through the bootstrap address they were given, and check the peer id there); it must accept the same
admission token and API key, or every node and client would need new ones; and it should serve the plan its
nodes already hold, or each would reload its shard. So the directory holds:

- `coordinator.key`: the libp2p identity (unless `--identity` names another file);
- `state.json`: the admission token and API key in use, the addresses it last bound (so that an address asked
  with port 0 gets the same port again), and the last plan that served, with its version.

`state.json` is written atomically (a new file renamed over the old) and readable by its owner only: it holds
secrets. A file that cannot be read is an error naming the file and the key, never silently replaced.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hetnode.errors import ConfigError

STATE_FILE = "state.json"
IDENTITY_FILE = "coordinator.key"


@dataclass
class SavedPlan:
    """The plan that last served: the planner's placement (PlacementPlan.to_json) and its version."""

    version: int
    placement: dict[str, Any]


@dataclass
class CoordinatorState:
    token: str | None = None
    api_key: str | None = None
    listen: list[str] = field(default_factory=list)  # the libp2p addresses bound last time
    api: str | None = None  # the REST API's host:port bound last time
    plan: SavedPlan | None = None


class StateDir:
    def __init__(self, path: Path) -> None:
        self.path = path.expanduser()
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(f"cannot create the state directory: {exc}", file=str(self.path)) from exc

    @property
    def identity(self) -> Path:
        return self.path / IDENTITY_FILE

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE

    def load(self) -> CoordinatorState:
        """The saved state; an empty one on first use."""
        path = self.state_file
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return CoordinatorState()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"unreadable coordinator state: {exc}", file=str(path)) from exc
        if not isinstance(data, dict):
            raise ConfigError("expected a JSON object", file=str(path))
        state = CoordinatorState()
        for key in ("token", "api_key", "api"):
            value = data.get(key)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"expected a string, got {type(value).__name__}", file=str(path), key=key)
            setattr(state, key, value)
        listen = data.get("listen", [])
        if not isinstance(listen, list) or not all(isinstance(a, str) for a in listen):
            raise ConfigError("expected a list of multiaddr strings", file=str(path), key="listen")
        state.listen = list(listen)
        plan = data.get("plan")
        if plan is not None:
            if (not isinstance(plan, dict) or not isinstance(plan.get("version"), int)
                    or not isinstance(plan.get("placement"), dict)):
                raise ConfigError("expected {version: int, placement: object}", file=str(path), key="plan")
            state.plan = SavedPlan(plan["version"], plan["placement"])
        return state

    def save(self, state: CoordinatorState) -> None:
        path = self.state_file
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(state), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)


def same_port(asked: str, bound: list[str]) -> str:
    """`asked` (a /ip4|ip6/HOST/tcp/PORT multiaddr) with the port bound last time at the same host and
    transport when it asks for port 0 (any free port): a restarted coordinator stays where its nodes look."""
    parts = asked.split("/")
    if len(parts) < 5 or parts[3] != "tcp" or parts[4] != "0":
        return asked
    for addr in bound:
        old = addr.split("/")
        if len(old) >= 5 and old[1:4] == parts[1:4] and old[4].isdigit():
            return "/".join([*parts[:4], old[4], *parts[5:]])
    return asked


def same_api_port(asked: str, bound: str | None) -> str:
    """`asked` (HOST:PORT) with last time's port when it asks for port 0 on the same host."""
    host, _, port = asked.rpartition(":")
    if port != "0" or not bound:
        return asked
    old_host, _, old_port = bound.rpartition(":")
    return f"{host}:{old_port}" if old_host == host and old_port.isdigit() else asked
