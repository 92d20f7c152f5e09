"""`hetnode testnet up|down|status|restart`: a coordinator and N node processes on 127.0.0.1.

Every child gets a pipe on which it writes one JSON readiness line once it serves (the coordinator once its API
is up, a node once it is admitted); the launcher waits on those lines, never on a timer. Keys, logs and the state
file live in the state directory. Attached children die with the launcher (PR_SET_PDEATHSIG); detached ones are
stopped by `testnet down`, which waits on their pidfds. `testnet restart NAME` stops one process of a detached
testnet (or finds it dead) and starts it again with the same command: the coordinator keeps its state directory
(identity, token, ports, last plan), a node its identity, so both come back as the same peers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import trio

from hetnode.errors import ConfigError, HetnodeError
from hetnode.planner.cluster import ClusterSpec, NodeSpec, load_cluster, uniform_cluster
from hetnode.planner.devices import parse_device
from hetnode.protocol.identity import load_or_create_identity, peer_id_of
from hetnode.testnet.emulation import write_link_emulation
from hetnode.testnet.netns import NetnsLayout, create, destroy, netns_problem, plan_layout, shape

SHIPPED = ("demo", "local3")
STOP_GRACE_S = 10.0


@dataclass
class Proc:
    name: str
    role: str
    pid: int
    log: str
    peer_id: str = ""
    cmd: list[str] = field(default_factory=list)  # its command line, without the readiness and lifeline fds
    metrics: str = ""  # a node's /metrics base URL (testnet up --metrics)


@dataclass
class TestnetState:
    api: str
    bootstrap: str
    token: str
    api_key: str | None
    state_dir: str
    started_at: float
    detached: bool
    cluster: str
    procs: list[Proc]
    netns: dict[str, Any] | None = None  # NetnsLayout.to_json() of a --netns testnet: what `down` removes

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.chmod(tmp, 0o600)
        tmp.replace(path)

    @staticmethod
    def load(path: Path) -> TestnetState:
        try:
            data = json.loads(path.read_text())
            data["procs"] = [Proc(**p) for p in data["procs"]]
            return TestnetState(**data)
        except FileNotFoundError:
            raise ConfigError("no testnet state here; start one with 'hetnode testnet up --detach'",
                              file=str(path)) from None
        except (ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"unreadable state file: {exc}", file=str(path)) from exc


def resolve_cluster_file(value: str) -> Path:
    if value in SHIPPED:
        return Path(str(resources.files("hetnode.testnet") / "clusters" / f"{value}.toml"))
    path = Path(value)
    if not path.exists():
        raise ConfigError(f"no such cluster file (shipped ones: {', '.join(SHIPPED)})", file=value)
    return path


def main(args: argparse.Namespace) -> int:
    if args.testnet_command == "up":
        return trio.run(up, args)
    if args.testnet_command == "down":
        return trio.run(down, args.state_dir)
    if args.testnet_command == "restart":
        return trio.run(restart, args)
    return status(args.state_dir)


# -- up ---------------------------------------------------------------------------------------------------


class Lifeline:
    """A pipe whose write end only the launcher holds: attached children watch the read end and shut down
    when it reaches EOF, which the kernel delivers whenever the launcher dies, even by SIGKILL."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_inheritable(self.read_fd, False)

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


async def _spawn(cmd: list[str], log_path: Path, env: dict[str, str], *, lifeline: Lifeline | None,
                 ready_timeout_s: float, name: str) -> tuple[trio.Process, dict[str, Any]]:
    """Start one child and wait for its readiness line."""
    r, w = os.pipe()
    fds: tuple[int, ...] = (w,)
    if lifeline is not None:
        cmd = [*cmd, "--lifeline-fd", str(lifeline.read_fd)]
        fds = (w, lifeline.read_fd)
    # A local append-open is instant; the child keeps its own copy of the descriptor after the fork.
    log_file = open(log_path, "ab")  # noqa: ASYNC230, SIM115
    try:
        proc = await trio.lowlevel.open_process(
            [*cmd, "--ready-fd", str(w)], stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            pass_fds=fds, env=env, start_new_session=True,
        )
    finally:
        os.close(w)
        log_file.close()
    line = b""
    async with trio.lowlevel.FdStream(r) as pipe:
        with trio.move_on_after(ready_timeout_s) as scope:
            while not line.endswith(b"\n"):
                chunk = await pipe.receive_some(4096)
                if not chunk:
                    break
                line += chunk
    if scope.cancelled_caught or not line.endswith(b"\n"):
        why = f"not ready after {ready_timeout_s:g} s" if scope.cancelled_caught else "exited before it was ready"
        if proc.returncode is None and scope.cancelled_caught:
            proc.kill()
        tail = _tail(log_path)
        raise HetnodeError(f"{name} {why}; last lines of {log_path}:\n{tail}")
    return proc, json.loads(line)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _alive(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"hetnode" in cmdline and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@dataclass
class Running:
    state: TestnetState
    cluster: ClusterSpec
    procs: list[tuple[Proc, trio.Process]]
    elapsed_s: float

    @property
    def state_path(self) -> Path:
        return Path(self.state.state_dir) / "state.json"


# The coordinator's planning options that `testnet up` takes too (cli._planning_args) and hands on as they are.
_FORWARDED = (("split_workload", "--split-workload"), ("reschedule_shift", "--reschedule-shift"),
              ("workload_window", "--workload-window"), ("slo", "--slo"), ("macro_bounds", "--macro-bounds"),
              ("scale_from", "--scale-from"), ("scale_window", "--scale-window"), ("scale_target", "--scale-target"),
              ("scale_low_use", "--scale-low-use"), ("scale_idle", "--scale-idle"),
              ("prefill_tokens", "--prefill-tokens"), ("decode_booking", "--decode-booking"))


def _workload_args(args: argparse.Namespace) -> list[str]:
    """What `testnet up` was told about the workload and the planning, for its coordinator. An option the caller's
    namespace lacks (one made before the option existed) is left to the coordinator's default."""
    out = []
    for dest, flag in _FORWARDED:
        if hasattr(args, dest):
            value = getattr(args, dest)
            out += [flag, ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return out


def _batching(args: argparse.Namespace) -> str:
    """The nodes' --batching: EcoServe's placement runs its instances' temporal batching unless told otherwise."""
    batching = getattr(args, "batching", "shared")
    return "ecoserve" if batching == "shared" and getattr(args, "placement", "") == "ecoserve" else batching


def join_args(args: argparse.Namespace, spec: NodeSpec, bootstrap: str, state_dir: Path,
              emulate: list[str], *, listen: str = "/ip4/127.0.0.1/tcp/0") -> list[str]:
    """The `hetnode join ...` arguments of one testnet node.

    No --retry-budget: nodes keep the default (an hour), so that a coordinator restarted by hand, or killed by
    a failover test, finds its nodes waiting for it rather than gone (they gave up after 30 s once).
    """
    cmd = ["join", "--bootstrap", bootstrap, "--listen", listen,
           "--identity", str(state_dir / "keys" / f"{spec.name}.key"), "--name", spec.name,
           "--region", spec.region, "--log-level", args.log_level, *emulate,
           "--kv-transfer", getattr(args, "kv_transfer", "policy"),
           "--batching", _batching(args)]
    if getattr(args, "kv_cache_mb", None) is not None:
        cmd += ["--kv-cache-mb", str(args.kv_cache_mb)]
    if getattr(args, "metrics", False):
        cmd += ["--metrics", f"{listen.split('/')[2]}:0"]  # the node's own address (its namespace's, with --netns)
    if spec.device != "cpu":
        cmd += ["--emulate", spec.device]
        if abs(spec.memory_gb * (1 << 30) - parse_device(spec.device).memory_bytes) >= 1 << 20:
            cmd += ["--memory-gb", str(spec.memory_gb)]  # the cluster file's override
        dilation = getattr(args, "compute_dilation", None)
        if dilation is not None:
            cmd += ["--compute-dilation", str(dilation)]
    return cmd


async def start(args: argparse.Namespace) -> Running:
    """Start the coordinator, then every node concurrently; returns once all are ready."""
    state_dir: Path = args.state_dir
    state_path = state_dir / "state.json"
    if state_path.exists():
        try:
            running = any(_alive(p.pid) for p in TestnetState.load(state_path).procs)
        except ConfigError:
            running = False  # an unreadable leftover is replaced
        if running:
            raise ConfigError("a testnet is already running from this state directory; "
                              "stop it with 'hetnode testnet down' or use --state-dir", file=str(state_path))
        state_path.unlink()

    if args.cluster:
        cluster_file: Path | None = resolve_cluster_file(args.cluster)
        cluster = load_cluster(cluster_file)
    else:
        cluster_file = None
        n = 3 if args.nodes is None else args.nodes
        if not 1 <= n <= 64:
            raise ConfigError("must be between 1 and 64", key="--nodes")
        cluster = uniform_cluster(n)

    (state_dir / "keys").mkdir(parents=True, exist_ok=True)
    # A new testnet's coordinator starts afresh (its token, ports and plan were another testnet's); only
    # `testnet restart` brings one back with them.
    (state_dir / "coordinator" / "state.json").unlink(missing_ok=True)
    log_dir = state_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for old_log in log_dir.glob("*.log"):
        old_log.unlink()

    names = ["coordinator", *[n.name for n in cluster.nodes]]
    layout: NetnsLayout | None = None
    if getattr(args, "netns", False):
        problem = netns_problem()
        if problem:
            raise ConfigError(f"cannot run in network namespaces: {problem}", key="--netns")
        layout = plan_layout(names)
        create(layout)
    peer_ids = {name: str(peer_id_of(load_or_create_identity(state_dir / "keys" / f"{name}.key")))
                for name in names}
    emulate: list[str] = []
    if cluster_file is not None:
        links_file = state_dir / "links.json"
        write_link_emulation(links_file, cluster_file.resolve(), {pid: name for name, pid in peer_ids.items()},
                             kernel_bandwidth=layout is not None)
        emulate = ["--emulate-links", str(links_file)]
    if layout is not None:
        try:
            shape(layout, cluster)
        except BaseException:
            destroy(layout)
            raise

    def where(name: str) -> tuple[list[str], str]:
        """The command prefix that runs a process in its namespace, and its listen address."""
        if layout is None:
            return [], "/ip4/127.0.0.1/tcp/0"
        return layout.exec_prefix(name), f"/ip4/{layout.address(name)}/tcp/0"

    token = args.token or secrets.token_urlsafe(16)
    # Many processes share this machine's cores: one compute thread each, and no OpenMP spin-waiting after a
    # step (an idle pool spinning for ~100 ms starves the hop that runs next).
    env = dict(os.environ, HETNODE_TOKEN=token, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               OMP_WAIT_POLICY="PASSIVE")
    if args.api_key:
        env["HETNODE_API_KEY"] = args.api_key
    else:
        env.pop("HETNODE_API_KEY", None)
    base = [sys.executable, "-m", "hetnode"]
    lifeline = None if args.detach else Lifeline()
    t0 = time.monotonic()
    procs: list[tuple[Proc, trio.Process]] = []
    try:
        coord_log = log_dir / "coordinator.log"
        prefix, listen = where("coordinator")
        api_bind = args.api if layout is None else f"{layout.address('coordinator')}:{args.api.rpartition(':')[2]}"
        coord_cmd = [
            *prefix, *base, "coordinator", "--listen", listen, "--api", api_bind,
            "--identity", str(state_dir / "keys" / "coordinator.key"), "--state-dir", str(state_dir / "coordinator"),
            "--heartbeat-deadline", str(args.heartbeat_deadline), "--log-level", args.log_level,
            "--probe-interval", str(getattr(args, "probe_interval", 60.0)),
            "--model", args.model, "--region", cluster.coordinator_region, "--placement",
            getattr(args, "placement", "helix"), "--scheduler", getattr(args, "scheduler", "iwrr"),
            "--kv-codec", getattr(args, "kv_codec", "auto"),
            "--plan-time-limit", str(getattr(args, "plan_time_limit", 10.0)),
            "--route-wait", str(getattr(args, "route_wait", 30.0)), *_workload_args(args), *emulate]
        cproc, ready = await _spawn(coord_cmd, coord_log, env, lifeline=lifeline,
                                    ready_timeout_s=args.ready_timeout, name="coordinator")
        procs.append((Proc("coordinator", "coordinator", cproc.pid, str(coord_log), ready["peer_id"], coord_cmd),
                       cproc))
        api, bootstrap = ready["api"], ready["addrs"][0]

        async def start_node(spec_index: int) -> None:
            spec = cluster.nodes[spec_index]
            log_path = log_dir / f"{spec.name}.log"
            prefix, listen = where(spec.name)
            cmd = [*prefix, *base, *join_args(args, spec, bootstrap, state_dir, emulate, listen=listen)]
            proc, node_ready = await _spawn(cmd, log_path, env, lifeline=lifeline,
                                            ready_timeout_s=args.ready_timeout, name=f"node {spec.name}")
            procs.append((Proc(spec.name, "node", proc.pid, str(log_path), node_ready["peer_id"], cmd,
                               node_ready.get("metrics") or ""), proc))

        async with trio.open_nursery() as nursery:
            for i in range(len(cluster.nodes)):
                nursery.start_soon(start_node, i)
    except BaseException:
        with trio.CancelScope(shield=True):
            await _stop([p for _, p in procs])
        if lifeline is not None:
            lifeline.close()
        if layout is not None:
            destroy(layout)
        raise
    if lifeline is not None:
        os.close(lifeline.read_fd)  # only the children need it; the launcher keeps the write end
    state = TestnetState(api=api, bootstrap=bootstrap, token=token, api_key=args.api_key,
                         state_dir=str(state_dir), started_at=time.time(), detached=args.detach,
                         cluster=str(cluster_file) if cluster_file else f"{len(cluster.nodes)} cpu nodes",
                         procs=[p for p, _ in procs], netns=layout.to_json() if layout is not None else None)
    state.save(state_path)
    return Running(state, cluster, procs, time.monotonic() - t0)


async def stop(running: Running) -> None:
    with trio.CancelScope(shield=True):
        await _stop([proc for _, proc in running.procs])
        if running.state.netns is not None:
            destroy(NetnsLayout.from_json(running.state.netns))
        running.state_path.unlink(missing_ok=True)


async def up(args: argparse.Namespace) -> int:
    running = await start(args)
    print_summary(running.state, running.cluster, running.elapsed_s)
    if args.detach:
        print("detached; stop it with: hetnode testnet down" +
              ("" if args.state_dir == _default_state_dir() else f" --state-dir {args.state_dir}"), flush=True)
        return 0
    print("press Ctrl-C to stop the testnet", flush=True)
    try:
        await supervise(running)
    finally:
        print("stopping the testnet...", flush=True)
        await stop(running)
        print("stopped", flush=True)
    return 0


def _default_state_dir() -> Path:
    from hetnode.cli import DEFAULT_HOME

    return DEFAULT_HOME / "testnet"


def print_summary(state: TestnetState, cluster: ClusterSpec, elapsed: float) -> None:
    print(f"testnet up in {elapsed:.1f} s: coordinator + {len(cluster.nodes)} nodes ({state.cluster})")
    for spec in cluster.nodes:
        print(f"  {spec.name:<14} {spec.device:<8} region {spec.region or '-'}")
    auth = f" -H 'Authorization: Bearer {state.api_key}'" if state.api_key else ""
    print(f"API:       {state.api}")
    print(f"dashboard: {state.api}/dashboard" + (f"#key={state.api_key}" if state.api_key else ""))
    for proc in state.procs:
        if proc.metrics:
            print(f"metrics:   {proc.name:<14} {proc.metrics}/metrics")
    print(f"bootstrap: {state.bootstrap}")
    print(f"token:     {state.token}")
    print(f"logs:      {Path(state.state_dir) / 'logs'}")
    print(f"try:       curl -s{auth} {state.api}/v1/cluster")
    print(f"join more: hetnode join --bootstrap {state.bootstrap} --token={state.token} --name extra-1", flush=True)


async def supervise(running: Running) -> None:
    """Until SIGINT/SIGTERM; report children that die on their own."""
    procs = running.procs
    async with trio.open_nursery() as nursery:

        async def watch(p: Proc, proc: trio.Process) -> None:
            code = await proc.wait()
            print(f"{p.role} {p.name} exited with code {code}; see {p.log}", flush=True)

        for p, proc in procs:
            nursery.start_soon(watch, p, proc)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


async def _stop(procs: list[trio.Process]) -> None:
    """Nodes first (they leave gracefully), then the coordinator; SIGKILL after the grace period."""
    nodes, coordinator = procs[1:], procs[:1]
    for group in (nodes, coordinator):
        for proc in group:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_GRACE_S):
            for proc in group:
                await proc.wait()
        for proc in group:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


# -- down / status ----------------------------------------------------------------------------------------


async def _wait_pid(pid: int, grace_s: float) -> bool:
    """Wait for a process that is not our child to exit, on its pidfd; True if it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        with trio.move_on_after(grace_s):
            await trio.lowlevel.wait_readable(fd)
            return True
        return not _alive(pid)
    finally:
        os.close(fd)


async def down(state_dir: Path) -> int:
    state_path = state_dir / "state.json"
    state = TestnetState.load(state_path)
    nodes = [p for p in state.procs if p.role == "node"]
    coordinator = [p for p in state.procs if p.role == "coordinator"]
    for group in (nodes, coordinator):
        live = [p for p in group if _alive(p.pid)]
        for p in live:
            os.kill(p.pid, signal.SIGTERM)
        for p in live:
            if not await _wait_pid(p.pid, STOP_GRACE_S):
                os.kill(p.pid, signal.SIGKILL)
                await _wait_pid(p.pid, 5)
    if state.netns is not None:
        destroy(NetnsLayout.from_json(state.netns))
    state_path.unlink(missing_ok=True)
    print(f"stopped {len(state.procs)} processes")
    return 0


async def restart(args: argparse.Namespace) -> int:
    """Stop one process of a detached testnet if it runs, start it again with its command, wait until ready."""
    state_path = args.state_dir / "state.json"
    state = TestnetState.load(state_path)
    if not state.detached:
        raise ConfigError("only a detached testnet's processes can be restarted (its launcher supervises the "
                          "others); start it with 'hetnode testnet up --detach'", file=str(state_path))
    proc = next((p for p in state.procs if p.name == args.name), None)
    if proc is None:
        raise ConfigError(f"no process {args.name!r} (there are: {', '.join(p.name for p in state.procs)})",
                          key="NAME")
    if not proc.cmd:
        raise ConfigError("this state file does not record the command lines (a testnet started by an older "
                          "hetnode); restart the whole testnet", file=str(state_path))
    if _alive(proc.pid):
        os.kill(proc.pid, signal.SIGKILL if args.kill else signal.SIGTERM)
        if not await _wait_pid(proc.pid, 0 if args.kill else STOP_GRACE_S):
            os.kill(proc.pid, signal.SIGKILL)
            await _wait_pid(proc.pid, 5)
    env = dict(os.environ, HETNODE_TOKEN=state.token, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               OMP_WAIT_POLICY="PASSIVE")
    if state.api_key:
        env["HETNODE_API_KEY"] = state.api_key
    else:
        env.pop("HETNODE_API_KEY", None)
    t0 = time.monotonic()
    child, ready = await _spawn(proc.cmd, Path(proc.log), env, lifeline=None, ready_timeout_s=args.ready_timeout,
                                name=f"{proc.role} {proc.name}")
    if ready.get("peer_id") != proc.peer_id:
        raise HetnodeError(f"{proc.name} came back as {ready.get('peer_id')}, not {proc.peer_id}")
    if proc.role == "coordinator" and ready.get("api") != state.api:
        raise HetnodeError(f"the coordinator came back at {ready.get('api')}, not {state.api}")
    proc.pid = child.pid
    proc.metrics = ready.get("metrics") or proc.metrics  # a node's listener port is a new free one
    state.save(state_path)
    print(f"{proc.role} {proc.name} restarted in {time.monotonic() - t0:.1f} s (pid {child.pid})", flush=True)
    return 0


def status(state_dir: Path) -> int:
    import httpx

    state = TestnetState.load(state_dir / "state.json")
    print(f"testnet from {state_dir} ({state.cluster}), started {time.ctime(state.started_at)}")
    print(f"API: {state.api}   bootstrap: {state.bootstrap}")
    for p in state.procs:
        print(f"  {p.role:<12} {p.name:<14} pid {p.pid:<8} {'running' if _alive(p.pid) else 'NOT RUNNING'}"
              + (f"  metrics {p.metrics}/metrics" if p.metrics else ""))
    headers = {"Authorization": f"Bearer {state.api_key}"} if state.api_key else {}
    try:
        view = httpx.get(f"{state.api}/v1/cluster", headers=headers, timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        print(f"coordinator API not answering: {exc}")
        return 1
    print(f"{view['up']} nodes up")
    for n in view["nodes"]:
        prof = n["profile"]
        print(f"  {n['name']:<14} {n['state']:<5} {prof['device']:<10} region {n['region'] or '-':<6} "
              f"{prof['matmul_tflops']:.1f} TFLOP/s {prof['mem_bandwidth_gbps']:.0f} GB/s")
    for lk in view["links"]:
        print(f"  link {lk['src_name']:>12} -> {lk['dst_name']:<12} {lk['bandwidth_mbps']:9.1f} Mbit/s "
              f"{lk['rtt_ms']:8.2f} ms RTT")
    return 0
