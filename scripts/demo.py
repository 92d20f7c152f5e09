"""The README's first command: a heterogeneous local testnet, shown working, kept up until Ctrl-C.

Starts the shipped demo cluster (emulated A100, L4 and T4 nodes in two regions with shaped links), waits until
every node is admitted and every link is measured, prints the cluster as the coordinator sees it, and keeps
the API up with a line that shows how to query it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
import trio

from hetnode.cli import report_error
from hetnode.errors import HetnodeError
from hetnode.testnet import launcher


async def main(cluster: str, state_dir: Path) -> int:
    args = argparse.Namespace(
        cluster=cluster, nodes=None, detach=False, state_dir=state_dir, api="127.0.0.1:0", api_key=None,
        token=None, heartbeat_deadline=5.0, ready_timeout=120.0, log_level="info")
    running = await launcher.start(args)
    try:
        launcher.print_summary(running.state, running.cluster, running.elapsed_s)
        n = len(running.cluster.nodes)
        # Each node measures its link to every other node and to the coordinator.
        async with httpx.AsyncClient(base_url=running.state.api, timeout=70) as client:
            r = await client.get("/v1/cluster", params={"min_up": n, "min_links": n * n, "timeout": 60})
            view = r.json()
        print(f"\n{view['up']} nodes up; measured links (Mbit/s, RTT ms):")
        for lk in view["links"]:
            print(f"  {lk['src_name']:>12} -> {lk['dst_name']:<12} {lk['bandwidth_mbps']:8.1f} {lk['rtt_ms']:8.2f}")
        print(f"\nquery it:  curl -s {running.state.api}/v1/cluster | python -m json.tool")
        print("press Ctrl-C to stop", flush=True)
        await launcher.supervise(running)
    finally:
        print("stopping the testnet...", flush=True)
        await launcher.stop(running)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cluster", default="demo", help="cluster file or shipped name (default: demo)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hetnode-demo-") as tmp:
        try:
            sys.exit(trio.run(main, opts.cluster, Path(tmp)))
        except HetnodeError as exc:
            sys.exit(report_error(exc))
