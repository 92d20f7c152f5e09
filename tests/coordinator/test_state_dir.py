"""The coordinator's state directory: what it keeps, how it refuses a damaged file, and the ports it reuses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetnode.cli import build_parser, main
from hetnode.coordinator.state_dir import CoordinatorState, SavedPlan, StateDir, same_api_port, same_port
from hetnode.errors import ConfigError


def test_state_round_trips_and_is_private(tmp_path: Path) -> None:
    store = StateDir(tmp_path / "c")
    assert store.load() == CoordinatorState()
    state = CoordinatorState(token="t", api_key="k", listen=["/ip4/127.0.0.1/tcp/4001/p2p/x"], api="127.0.0.1:8000",
                             plan=SavedPlan(7, {"method": "helix", "placements": []}))
    store.save(state)
    assert store.load() == state
    assert os.stat(store.state_file).st_mode & 0o077 == 0
    assert not list(store.path.glob("*.tmp"))


@pytest.mark.parametrize(("text", "key"), [
    ("{not json", None),
    ("[1, 2]", None),
    ('{"token": 5}', "token"),
    ('{"listen": "/ip4/1.2.3.4/tcp/1"}', "listen"),
    ('{"plan": {"version": "7", "placement": {}}}', "plan"),
])
def test_a_damaged_state_file_is_an_error_naming_file_and_key(tmp_path: Path, text: str, key: str | None) -> None:
    store = StateDir(tmp_path)
    store.state_file.write_text(text)
    with pytest.raises(ConfigError) as info:
        store.load()
    assert info.value.file == str(store.state_file) and info.value.key == key


def test_port_zero_gets_last_times_port_at_the_same_host() -> None:
    bound = ["/ip4/127.0.0.1/tcp/37867/p2p/12D3KooWFAW5"]
    assert same_port("/ip4/127.0.0.1/tcp/0", bound) == "/ip4/127.0.0.1/tcp/37867"
    assert same_port("/ip4/0.0.0.0/tcp/0", bound) == "/ip4/0.0.0.0/tcp/0"  # another host: any free port
    assert same_port("/ip4/127.0.0.1/tcp/4001", bound) == "/ip4/127.0.0.1/tcp/4001"  # asked for a port: kept
    assert same_port("/ip4/127.0.0.1/tcp/0", []) == "/ip4/127.0.0.1/tcp/0"
    assert same_api_port("127.0.0.1:0", "127.0.0.1:34087") == "127.0.0.1:34087"
    assert same_api_port("127.0.0.1:8000", "127.0.0.1:34087") == "127.0.0.1:8000"
    assert same_api_port("0.0.0.0:0", "127.0.0.1:34087") == "0.0.0.0:0"
    assert same_api_port("127.0.0.1:0", None) == "127.0.0.1:0"


def test_coordinator_with_a_damaged_state_dir_exits_2_with_the_file(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "state.json").write_text('{"api_key": []}')
    args = build_parser().parse_args(["coordinator", "--state-dir", str(tmp_path), "--model", "none"])
    assert args.state_dir == tmp_path and args.identity is None
    assert main(["coordinator", "--state-dir", str(tmp_path), "--model", "none", "--api", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "state.json") in err and "api_key" in err


def test_restart_without_a_testnet_says_so(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["testnet", "restart", "node-9", "--state-dir", str(tmp_path)]) == 2
    assert "no testnet state here" in capsys.readouterr().err
