"""A peer's persistent Ed25519 libp2p identity.

File format: the libp2p `PrivateKey` protobuf from the peer-id spec
(https://github.com/libp2p/specs/blob/master/peer-ids/peer-ids.md), `Type = Ed25519` and `Data` = the
32-byte seed followed by the 32-byte public key (64 bytes; the form go-libp2p and rust-libp2p write). On
reading, `Data` of 32 bytes (a bare seed, which is what py-libp2p's own `save_identity` writes) is accepted
too. The file is binary, 68 bytes, mode 0600; losing it means the node gets a new peer id.

A new file is written to a temporary name and hard-linked into place, so a reader never sees half a key
and two processes starting at once on the same path end up with the same identity instead of the last
writer silently winning.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.ed25519 import create_new_key_pair as _new_ed25519_key_pair
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.pb import crypto_pb2
from libp2p.peer.id import ID

from hetnode.errors import ConfigError
from hetnode.ids import NodeId

log = logging.getLogger(__name__)

_SEED_LEN = 32
_PUB_LEN = 32
# A key file is a few dozen bytes; anything much larger is not one (and is not worth reading into memory).
_MAX_FILE_BYTES = 4096


def peer_id_of(key_pair: KeyPair) -> NodeId:
    """The base58 peer id ("12D3KooW...") that this key pair has on the network."""
    return NodeId(ID.from_pubkey(key_pair.public_key).to_base58())


def load_or_create_identity(path: str | Path | None) -> KeyPair:
    """The key pair stored at path, creating the file (and its parent folders) on first use.

    None gives a fresh key that lives only as long as the process (tests, throwaway testnet nodes).
    Raises ConfigError if the file exists but cannot be read or does not hold an Ed25519 key."""
    if path is None:
        return _new_ed25519_key_pair()
    path = Path(path).expanduser()
    try:
        return _read_identity(path)
    except FileNotFoundError:
        pass
    return _create_identity(path)


def encode_identity(key_pair: KeyPair) -> bytes:
    """The key file's bytes for key_pair (see the module docstring)."""
    private = key_pair.private_key
    if not isinstance(private, Ed25519PrivateKey):
        raise ValueError(f"only Ed25519 identities are supported, not {private.get_type().name}")
    msg = crypto_pb2.PrivateKey(
        key_type=crypto_pb2.KeyType.Ed25519,
        data=private.to_bytes() + key_pair.public_key.to_bytes(),
    )
    return bytes(msg.SerializeToString())


def decode_identity(data: bytes) -> KeyPair:
    """The key pair in a key file's bytes; raises ValueError with a readable reason."""
    msg = crypto_pb2.PrivateKey()
    try:
        msg.ParseFromString(data)
    except Exception as exc:  # protobuf's DecodeError does not share a useful base with anything else
        raise ValueError(f"not a libp2p private key protobuf ({exc})") from exc
    if not msg.HasField("key_type") or not msg.HasField("data"):
        raise ValueError("not a libp2p private key protobuf (type or data missing)")
    if msg.key_type != KeyType.Ed25519.value:
        names = {t.value: t.name for t in KeyType}
        raise ValueError(f"holds a {names.get(msg.key_type, str(msg.key_type))} key; hetnode needs Ed25519")
    raw = bytes(msg.data)
    if len(raw) not in (_SEED_LEN, _SEED_LEN + _PUB_LEN):
        raise ValueError(f"Ed25519 key data is {len(raw)} bytes, expected 32 or 64")
    try:
        private = Ed25519PrivateKey.from_bytes(raw[:_SEED_LEN])
    except Exception as exc:
        raise ValueError(f"invalid Ed25519 seed ({exc})") from exc
    public = private.get_public_key()
    if len(raw) > _SEED_LEN and raw[_SEED_LEN:] != public.to_bytes():
        # The stored public half does not belong to the seed: the file was damaged or hand-edited.
        raise ValueError("Ed25519 key data is inconsistent (public key does not match the seed)")
    return KeyPair(private, public)


def _read_identity(path: Path) -> KeyPair:
    """Raises FileNotFoundError if there is no file, ConfigError if there is one we cannot use."""
    try:
        # O_NONBLOCK: opening a FIFO put at the path must fail below, not wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError("the identity key path is not a regular file", file=str(path))
            data = f.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfigError(f"cannot read the identity key file: {exc.strerror or exc}",
                          file=str(path)) from exc
    if len(data) > _MAX_FILE_BYTES:
        raise ConfigError("not an identity key file (too large)", file=str(path))
    try:
        key_pair = decode_identity(data)
    except ValueError as exc:
        raise ConfigError(f"corrupt identity key file: {exc}; move it away to create a new identity "
                          "(the node will get a new peer id)", file=str(path)) from exc
    if os.name == "posix" and st.st_mode & 0o077:
        log.warning("identity key file %s is readable by other users (mode %o); chmod 600 it",
                    path, st.st_mode & 0o777)
    return key_pair


def _create_identity(path: Path) -> KeyPair:
    key_pair = _new_ed25519_key_pair()
    data = encode_identity(key_pair)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp creates the file 0600 from the start, so the key is never readable by others.
        fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                # link() fails if the name exists, unlike rename(): if another process created the
                # identity meanwhile, its key wins and we use it instead of overwriting it.
                os.link(tmp, path)
            except FileExistsError:
                return _read_identity(path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise ConfigError(f"cannot create the identity key file: {exc.strerror or exc}",
                          file=str(path)) from exc
    log.info("created a new identity %s in %s", peer_id_of(key_pair), path)
    return key_pair


def _fsync_dir(folder: Path) -> None:
    """Make the new directory entry durable, so a crash right after start-up does not lose the key."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
