"""The persistent Ed25519 identity: created once, read back unchanged, and refused clearly when damaged."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.pb import crypto_pb2
from libp2p.crypto.rsa import create_new_key_pair as create_new_rsa_key_pair
from libp2p.identity_utils import save_identity
from libp2p.peer.id import ID

from hetnode.errors import ConfigError
from hetnode.protocol import identity
from hetnode.protocol.identity import decode_identity, encode_identity, load_or_create_identity, peer_id_of


def test_no_path_gives_a_fresh_ephemeral_key() -> None:
    a, b = load_or_create_identity(None), load_or_create_identity(None)
    assert peer_id_of(a) != peer_id_of(b)
    assert peer_id_of(a).startswith("12D3KooW")  # Ed25519 keys inline in the peer id
    assert ID.from_base58(peer_id_of(a)) == ID.from_pubkey(a.public_key)


def test_created_on_first_use_and_stable_afterwards(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "node.key"
    first = load_or_create_identity(path)
    assert path.is_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 68  # protobuf: type (2 bytes) + data header (2) + seed and public key (64)
    again = load_or_create_identity(str(path))
    assert peer_id_of(again) == peer_id_of(first)
    assert again.private_key.to_bytes() == first.private_key.to_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == ["node.key"]  # no temporary files left behind


def test_signatures_survive_a_round_trip(tmp_path: Path) -> None:
    key = load_or_create_identity(tmp_path / "k")
    loaded = load_or_create_identity(tmp_path / "k")
    assert loaded.public_key.verify(b"msg", key.private_key.sign(b"msg"))


def test_file_is_the_standard_64_byte_libp2p_form(tmp_path: Path) -> None:
    key = load_or_create_identity(tmp_path / "k")
    msg = crypto_pb2.PrivateKey()
    msg.ParseFromString((tmp_path / "k").read_bytes())
    assert msg.key_type == crypto_pb2.KeyType.Ed25519
    assert msg.data == key.private_key.to_bytes() + key.public_key.to_bytes()


def test_reads_the_file_py_libp2p_writes(tmp_path: Path) -> None:
    key = create_new_key_pair()
    save_identity(key, tmp_path / "py.key")  # 32-byte seed in the protobuf
    assert peer_id_of(load_or_create_identity(tmp_path / "py.key")) == peer_id_of(key)


def test_a_concurrent_creator_wins_without_being_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "k"
    theirs = create_new_key_pair()
    path.write_bytes(encode_identity(theirs))
    # As if another process created the file between our "not found" and our link into place.
    assert peer_id_of(identity._create_identity(path)) == peer_id_of(theirs)
    assert decode_identity(path.read_bytes()).public_key == theirs.public_key


def _protobuf(key_type: int, data: bytes) -> bytes:
    return bytes(crypto_pb2.PrivateKey(key_type=key_type, data=data).SerializeToString())  # type: ignore[arg-type]


GOOD = create_new_key_pair()
CORRUPT = {
    "empty": b"",
    "garbage": b"this is not a key file\n",
    "truncated": encode_identity(GOOD)[:40],
    "wrong_length": _protobuf(crypto_pb2.KeyType.Ed25519, b"\x01" * 48),
    "mismatched_public_half": _protobuf(crypto_pb2.KeyType.Ed25519,
                                        GOOD.private_key.to_bytes() + create_new_key_pair().public_key.to_bytes()),
    "rsa_key": create_new_rsa_key_pair(bits=1024).private_key.serialize(),
    "too_large": b"\x00" * 100_000,
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_damaged_file_is_a_config_error(tmp_path: Path, case: str) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(CORRUPT[case])
    with pytest.raises(ConfigError) as err:
        load_or_create_identity(path)
    assert err.value.file == str(path)
    assert "identity key file" in err.value.problem
    assert path.read_bytes() == CORRUPT[case]  # never replaced: that would silently change the peer id


def test_rsa_key_is_named_in_the_error(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    path.write_bytes(CORRUPT["rsa_key"])
    with pytest.raises(ConfigError, match="RSA key; hetnode needs Ed25519"):
        load_or_create_identity(path)


def test_a_directory_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="identity key file"):
        load_or_create_identity(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ConfigError, match="not a regular file"):
        load_or_create_identity(tmp_path / "fifo")


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "node.key"
    load_or_create_identity(path)
    path.chmod(0)
    with pytest.raises(ConfigError, match="cannot read"):
        load_or_create_identity(path)


def test_uncreatable_file_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied")

    # Root may write anywhere, so the refusal is simulated where the file would be created.
    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError, match="cannot create the identity key file: Permission denied"):
        load_or_create_identity(tmp_path / "node.key")
    assert not (tmp_path / "node.key").exists()
