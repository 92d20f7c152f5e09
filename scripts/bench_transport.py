"""Transport benchmark: our libp2p transport against raw trio TCP, between two processes on loopback.

    python scripts/bench_transport.py            # 64 MiB in 1 MiB frames, 2000 round trips of 64 bytes
    python scripts/bench_transport.py --quick    # a smoke test (a few seconds)
    python scripts/bench_transport.py --json out.json

Both sides use the same `FramedStream` (4-byte length prefix), so the difference is the transport alone:
TCP + Noise + yamux in py-libp2p against a bare trio socket. The server runs in a subprocess of this script
(`--serve`), prints one READY line with its addresses, and exits when its stdin closes. Throughput is timed
from the first byte until the server acknowledges the last one; a round trip is one 64-byte frame there and
back on an open stream. Connections are warmed up (windows grown, code paths run once) before timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

# Run as a file (python scripts/bench_transport.py) from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hetnode.ids import NodeId, ProtocolId
from hetnode.protocol.framing import FramedStream
from hetnode.protocol.identity import load_or_create_identity
from hetnode.protocol.libp2p_transport import open_libp2p_transport
from hetnode.protocol.transport import Stream

SCRIPT = Path(__file__).resolve()
BULK = ProtocolId("/hetnode/bench/bulk/1")
ECHO = ProtocolId("/hetnode/bench/echo/1")
FRAME_LIMIT = 2 << 20
READY = "READY"
_ACK = struct.Struct(">Q")


@dataclass(frozen=True)
class BenchParams:
    total_bytes: int = 64 << 20
    frame_bytes: int = 1 << 20
    round_trips: int = 2000
    message_bytes: int = 64
    repeats: int = 3  # throughput runs per transport; the median is reported

    @classmethod
    def quick(cls) -> BenchParams:
        return cls(total_bytes=8 << 20, round_trips=200, repeats=1)


# -- raw TCP with the same framing --------------------------------------------------------------------


class TcpStream:
    """A trio socket as a `Stream`, so that FramedStream runs unchanged over raw TCP."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self._sock = sock

    @property
    def remote_peer(self) -> NodeId:
        return NodeId("tcp")

    @property
    def protocol_id(self) -> ProtocolId:
        return ProtocolId("tcp")

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return bytes(await self._sock.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._sock.send_all(memoryview(data))

    async def close(self) -> None:
        await self._sock.send_eof()

    async def reset(self) -> None:
        await self._sock.aclose()


# -- server (the subprocess) --------------------------------------------------------------------------


async def serve_bulk(framed: FramedStream) -> None:
    total = 0
    while (frame := await framed.receive_frame()) is not None:
        total += len(frame)
    await framed.send_frame(_ACK.pack(total))
    await framed.aclose()


async def serve_echo(framed: FramedStream) -> None:
    while (frame := await framed.receive_frame()) is not None:
        await framed.send_frame(frame)
    await framed.aclose()


async def serve_libp2p_bulk(stream: Stream) -> None:
    await serve_bulk(FramedStream(stream, max_frame=FRAME_LIMIT))


async def serve_libp2p_echo(stream: Stream) -> None:
    await serve_echo(FramedStream(stream, max_frame=FRAME_LIMIT))


async def serve_tcp_connection(sock: trio.SocketStream) -> None:
    # One FramedStream for the whole connection: it reads ahead, so a second one would lose those bytes.
    framed = FramedStream(TcpStream(sock), max_frame=FRAME_LIMIT)
    try:
        mode = await framed.receive_frame()  # which benchmark, before any timing
        if mode == b"bulk":
            await serve_bulk(framed)
        elif mode == b"echo":
            await serve_echo(framed)
    finally:
        await sock.aclose()


async def serve() -> None:
    """Listen on both transports, print READY with the addresses, run until stdin closes."""
    async with trio.open_nursery() as nursery, \
            open_libp2p_transport(load_or_create_identity(None), ["/ip4/127.0.0.1/tcp/0"]) as transport:
        transport.set_handler(BULK, serve_libp2p_bulk)
        transport.set_handler(ECHO, serve_libp2p_echo)
        listeners = await nursery.start(partial(trio.serve_tcp, serve_tcp_connection, 0, host="127.0.0.1"))
        tcp_port = listeners[0].socket.getsockname()[1]
        print(READY, json.dumps({"libp2p": transport.listen_addrs()[0], "tcp_port": tcp_port}), flush=True)
        # The parent closes our stdin when it is done (or dies): that is our signal to stop.
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        async with stdin:
            while await stdin.receive_some():
                pass
        nursery.cancel_scope.cancel()


# -- client -------------------------------------------------------------------------------------------


async def measure_throughput(framed: FramedStream, p: BenchParams) -> float:
    """MB/s (10^6 bytes per second) of p.total_bytes in p.frame_bytes frames, until the server's ack."""
    payload = os.urandom(p.frame_bytes)
    start = time.perf_counter()
    for _ in range(p.total_bytes // p.frame_bytes):
        await framed.send_frame(payload)
    await framed.aclose()
    ack = await framed.receive_frame()
    elapsed = time.perf_counter() - start
    if ack is None or _ACK.unpack(ack)[0] != p.total_bytes:
        raise RuntimeError(f"server acknowledged {ack!r}, expected {p.total_bytes} bytes")
    return p.total_bytes / elapsed / 1e6


async def measure_round_trips(framed: FramedStream, p: BenchParams, n: int) -> list[float]:
    """Seconds per round trip of one p.message_bytes frame."""
    msg = os.urandom(p.message_bytes)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await framed.send_frame(msg)
        if await framed.receive_frame() != msg:
            raise RuntimeError("echo mismatch")
        times.append(time.perf_counter() - start)
    await framed.aclose()
    if await framed.receive_frame() is not None:
        raise RuntimeError("echo stream did not end cleanly")
    return times


def _summary(throughputs: list[float], rtts: list[float], connect_s: float) -> dict[str, float]:
    rtts_us = sorted(t * 1e6 for t in rtts)
    return {
        "throughput_MBps": statistics.median(throughputs),
        "throughput_best_MBps": max(throughputs),
        "rtt_median_us": statistics.median(rtts_us),
        "rtt_p90_us": rtts_us[int(0.9 * (len(rtts_us) - 1))],
        "rtt_p99_us": rtts_us[int(0.99 * (len(rtts_us) - 1))],
        "connect_ms": connect_s * 1e3,
    }


async def bench_libp2p(addr: str, p: BenchParams) -> dict[str, float]:
    async with open_libp2p_transport(load_or_create_identity(None), ["/ip4/127.0.0.1/tcp/0"]) as t:
        start = time.perf_counter()
        peer = await t.connect(addr)
        connect_s = time.perf_counter() - start

        async def framed(protocol_id: ProtocolId) -> FramedStream:
            return FramedStream(await t.open_stream(peer, protocol_id), max_frame=FRAME_LIMIT)

        warm = BenchParams(total_bytes=min(p.total_bytes, 16 << 20), frame_bytes=p.frame_bytes)
        await measure_throughput(await framed(BULK), warm)
        throughputs = [await measure_throughput(await framed(BULK), p) for _ in range(p.repeats)]
        await measure_round_trips(await framed(ECHO), p, 50)
        rtts = await measure_round_trips(await framed(ECHO), p, p.round_trips)
    return _summary(throughputs, rtts, connect_s)


async def bench_tcp(port: int, p: BenchParams) -> dict[str, float]:
    start = time.perf_counter()
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    connect_s = time.perf_counter() - start
    await sock.aclose()
    socks: list[trio.SocketStream] = []

    async def framed(mode: bytes) -> FramedStream:
        sock = await trio.open_tcp_stream("127.0.0.1", port)
        socks.append(sock)
        f = FramedStream(TcpStream(sock), max_frame=FRAME_LIMIT)
        await f.send_frame(mode)
        return f

    try:
        warm = BenchParams(total_bytes=min(p.total_bytes, 16 << 20), frame_bytes=p.frame_bytes)
        await measure_throughput(await framed(b"bulk"), warm)
        throughputs = [await measure_throughput(await framed(b"bulk"), p) for _ in range(p.repeats)]
        await measure_round_trips(await framed(b"echo"), p, 50)
        rtts = await measure_round_trips(await framed(b"echo"), p, p.round_trips)
    finally:
        for sock in socks:
            await sock.aclose()
    return _summary(throughputs, rtts, connect_s)


async def _read_ready_line(proc: trio.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    buf = bytearray()
    while True:
        chunk = await proc.stdout.receive_some(4096)
        if not chunk:
            raise RuntimeError("the benchmark server exited before it was ready")
        buf += chunk
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf = bytearray(rest)
            text = line.decode(errors="replace")
            if text.startswith(READY + " "):
                info: dict[str, Any] = json.loads(text[len(READY) + 1:])
                return info
            print(f"[server] {text}", file=sys.stderr)


async def transport_bench(p: BenchParams) -> dict[str, Any]:
    """The benchmark inside a running trio loop (run_transport_bench starts one)."""
    cmd = [sys.executable, str(SCRIPT), "--serve"]
    proc = await trio.lowlevel.open_process(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with trio.fail_after(60):
            server = await _read_ready_line(proc)
        libp2p = await bench_libp2p(server["libp2p"], p)
        tcp = await bench_tcp(int(server["tcp_port"]), p)
    finally:
        assert proc.stdin is not None
        await proc.stdin.aclose()  # the server's signal to exit
        with trio.move_on_after(10):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return {
        "params": asdict(p),
        "libp2p": libp2p,
        "tcp": tcp,
        "ratio_libp2p_over_tcp": {
            "throughput": libp2p["throughput_MBps"] / tcp["throughput_MBps"],
            "rtt_median": libp2p["rtt_median_us"] / tcp["rtt_median_us"],
        },
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }


def run_transport_bench(params: BenchParams | None = None) -> dict[str, Any]:
    """Run the whole transport benchmark (server subprocess included) and return its numbers."""
    return trio.run(transport_bench, params or BenchParams())


def format_table(result: dict[str, Any]) -> str:
    p, lp, tcp, ratio = result["params"], result["libp2p"], result["tcp"], result["ratio_libp2p_over_tcp"]
    rows = [
        ("throughput, MB/s (median)", "throughput_MBps", "{:10.1f}"),
        ("throughput, MB/s (best)", "throughput_best_MBps", "{:10.1f}"),
        ("round trip, us (median)", "rtt_median_us", "{:10.1f}"),
        ("round trip, us (p90)", "rtt_p90_us", "{:10.1f}"),
        ("round trip, us (p99)", "rtt_p99_us", "{:10.1f}"),
        ("connect, ms", "connect_ms", "{:10.2f}"),
    ]
    lines = [
        f"transport benchmark: two processes on loopback, {p['total_bytes'] >> 20} MiB in "
        f"{p['frame_bytes'] >> 10} KiB frames (x{p['repeats']}), {p['round_trips']} round trips of "
        f"{p['message_bytes']} B",
        f"{'':28}{'libp2p':>10}  {'raw TCP':>10}  {'libp2p/TCP':>10}",
    ]
    for label, key, fmt in rows:
        lines.append(f"{label:28}{fmt.format(lp[key])}  {fmt.format(tcp[key])}  {lp[key] / tcp[key]:10.2f}")
    lines.append(f"ratios libp2p/raw: throughput {ratio['throughput']:.2f}x, "
                 f"median round trip {ratio['rtt_median']:.2f}x")
    return "\n".join(lines)


async def testnet_startup(nodes: int, model: str) -> float:
    """Seconds from `hetnode testnet up --nodes N` to every process ready (nodes admitted), then stopped."""
    import tempfile

    from hetnode.testnet import launcher

    with tempfile.TemporaryDirectory(prefix="hetnode-bench-") as tmp:
        args = argparse.Namespace(cluster=None, nodes=nodes, model=model, detach=False, state_dir=Path(tmp),
                                  api="127.0.0.1:0", api_key=None, token=None, heartbeat_deadline=5.0,
                                  ready_timeout=300.0, log_level="warning")
        t0 = trio.current_time()
        running = await launcher.start(args)
        elapsed = trio.current_time() - t0
        await launcher.stop(running)
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers as JSON")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the subprocess side
    parser.add_argument("--no-testnet", action="store_true", help="skip the testnet start-up timing")
    args = parser.parse_args()
    if args.serve:
        trio.run(serve)
        return 0
    result = run_transport_bench(BenchParams.quick() if args.quick else BenchParams())
    print(format_table(result))
    if not args.no_testnet:
        # Ready means every process serves: the coordinator's API is up and every node is admitted (the
        # control plane; with a model, nodes then load their layers in the background).
        startup = {n: trio.run(testnet_startup, n, "none") for n in ((2,) if args.quick else (4, 8))}
        result["testnet_up_s"] = startup
        print("\ntestnet up (coordinator + N node processes, to all ready), 2 cores:")
        for n, secs in startup.items():
            print(f"  N = {n}: {secs:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
