"""`join --bootstrap-fd`: how a testnet node started beside its coordinator learns the coordinator's address."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from hetnode.cli import _read_bootstrap, main
from hetnode.errors import ConfigError

ADDR = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWShetgUfYVGPw3ycfVBNGqXMk6cCWmcVuqGiigfoHzH2W"


def _pipe_with(data: bytes) -> int:
    r, w = os.pipe()
    os.write(w, data)
    os.close(w)
    return r


async def test_the_addresses_written_before_eof_are_read() -> None:
    assert await _read_bootstrap(_pipe_with(f"{ADDR}\n{ADDR}\n".encode())) == [ADDR, ADDR]
    assert await _read_bootstrap(None) == []


async def test_eof_without_an_address_or_a_malformed_one_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="no bootstrap address"):
        await _read_bootstrap(_pipe_with(b""))
    with pytest.raises(ConfigError, match="malformed bootstrap"):
        await _read_bootstrap(_pipe_with(b"/ip4/127.0.0.1/tcp/4001\n"))


async def test_a_reader_waits_for_the_writer() -> None:
    r, w = os.pipe()
    async with trio.open_nursery() as nursery:
        got: list[list[str]] = []

        async def read() -> None:
            got.append(await _read_bootstrap(r))

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert got == []  # blocked on the pipe: the coordinator does not listen yet
        os.write(w, ADDR.encode())
        os.close(w)
    assert got == [[ADDR]]


def test_join_without_any_bootstrap_is_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["join", "--token", "t"])
    assert exc.value.code == 2
