"""`testnet up`'s summary: the join hint it prints is a command that works when pasted, whatever the token."""

from __future__ import annotations

import shlex

import pytest

from hetnode.cli import build_parser
from hetnode.planner.cluster import ClusterSpec, NodeSpec
from hetnode.testnet import launcher


@pytest.mark.parametrize("token", ["-starts-with-a-dash", "plain_Token-9"])
def test_the_printed_join_hint_parses_back_to_the_same_token(token: str, capsys: pytest.CaptureFixture[str]) -> None:
    state = launcher.TestnetState(api="http://127.0.0.1:8000", bootstrap="/ip4/127.0.0.1/tcp/4001/p2p/QmPeer",
                                  token=token, api_key=None, state_dir="/tmp/tn", started_at=0.0, detached=True,
                                  cluster="1 cpu nodes", procs=[])
    cluster = ClusterSpec(name="one", nodes=(NodeSpec(name="n0", device="cpu", region="", memory_gb=1.0),),
                          coordinator_region="")
    launcher.print_summary(state, cluster, 1.0)
    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("join more:"))
    argv = shlex.split(hint.removeprefix("join more:"))
    assert argv[0] == "hetnode"
    args = build_parser().parse_args(argv[1:])
    assert args.token == token and args.bootstrap == [state.bootstrap]
