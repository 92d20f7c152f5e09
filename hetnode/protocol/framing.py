"""Length-prefixed frames over a Stream, typed messages in them, and tensor payloads as raw frames.

A frame is a 4-byte big-endian unsigned length followed by that many bytes. A typed message is one frame of
MessagePack (msgspec, validated on decode). A tensor travels as a message that carries its `TensorMeta`
(dtype, shape), followed by one raw frame with exactly `meta.nbytes()` bytes; the bytes are never copied into
the MessagePack body.

Anything malformed raises ProtocolError; `reject` answers it with an ErrorReply and resets the stream.
"""

from __future__ import annotations

import logging
import struct
from typing import TypeVar

import msgspec
import trio

from hetnode.errors import FrameTooLarge, ProtocolError, StreamClosed
from hetnode.protocol.messages import ErrorReply, TensorMeta
from hetnode.protocol.transport import Stream

log = logging.getLogger(__name__)

T = TypeVar("T")

_LEN = struct.Struct(">I")
# Control messages are small; a profile or a link report of a few hundred peers stays far below this.
DEFAULT_MAX_FRAME = 1 << 20
# Activation and KV frames: a 4096-token prefill of a 8192-wide model in fp16 is 64 MiB.
DEFAULT_MAX_TENSOR_FRAME = 256 << 20
_RECV_CHUNK = 1 << 16
# Frames up to this size go out in one write together with their length prefix.
_COALESCE_BYTES = 64 << 10
# How much a rejected peer may still send while we wait for it to read our error reply.
_LINGER_DRAIN_BYTES = 1 << 20

_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class FramedStream:
    """Frames and typed messages over one Stream. Safe for one reader task and any number of writer tasks."""

    def __init__(self, stream: Stream, *, max_frame: int = DEFAULT_MAX_FRAME,
                 max_tensor_frame: int = DEFAULT_MAX_TENSOR_FRAME) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self.max_tensor_frame = max_tensor_frame
        self._buf = bytearray()
        self._send_lock = trio.Lock()

    # -- raw frames -------------------------------------------------------------------------------------

    async def send_frame(self, payload: bytes | bytearray | memoryview) -> None:
        async with self._send_lock:
            await self._send_frame_locked(payload)

    async def _send_frame_locked(self, payload: bytes | bytearray | memoryview) -> None:
        n = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
        if n > 0xFFFFFFFF:
            raise FrameTooLarge(f"frame of {n} bytes cannot be length-prefixed")
        if n <= _COALESCE_BYTES:
            # One write for small frames: a separate 4-byte write costs a whole yamux frame and a syscall.
            await self.stream.send_all(_LEN.pack(n) + bytes(payload))
        else:
            await self.stream.send_all(_LEN.pack(n))
            await self.stream.send_all(payload)

    async def _fill(self, n: int) -> bool:
        """Buffer at least n bytes; False at a clean EOF before any byte of them arrived."""
        start = len(self._buf)
        while len(self._buf) < n:
            chunk = await self.stream.receive_some(max(_RECV_CHUNK, n - len(self._buf)))
            if not chunk:
                if len(self._buf) == 0 and start == 0:
                    return False
                raise ProtocolError(
                    f"stream ended inside a frame ({len(self._buf)} of {n} bytes received)")
            self._buf += chunk
        return True

    async def receive_frame(self, *, limit: int | None = None) -> bytes | None:
        """The next frame's payload, or None at a clean end of stream between frames."""
        limit = self.max_frame if limit is None else limit
        if not await self._fill(4):
            return None
        (n,) = _LEN.unpack_from(self._buf, 0)
        if n > limit:
            raise FrameTooLarge(f"frame of {n} bytes is over the limit of {limit} bytes")
        await self._fill(4 + n)
        payload = bytes(self._buf[4:4 + n])
        del self._buf[:4 + n]
        return payload

    # -- typed messages ---------------------------------------------------------------------------------

    async def send_msg(self, msg: msgspec.Struct) -> None:
        await self.send_frame(encode(msg))

    async def receive_msg(self, decoder: msgspec.msgpack.Decoder[T]) -> T | None:
        """The next message, validated; None at a clean end of stream. Raises ProtocolError."""
        frame = await self.receive_frame()
        if frame is None:
            return None
        try:
            return decoder.decode(frame)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ProtocolError(f"malformed message: {exc}") from exc

    async def expect_msg(self, decoder: msgspec.msgpack.Decoder[T]) -> T:
        """Like receive_msg, but the end of the stream is an error here."""
        msg = await self.receive_msg(decoder)
        if msg is None:
            raise StreamClosed("stream ended while a message was expected")
        return msg

    # -- tensors ----------------------------------------------------------------------------------------

    async def send_with_payload(self, msg: msgspec.Struct, payload: bytes | bytearray | memoryview) -> None:
        """A message and the raw frame that follows it, atomically with respect to other writers."""
        header = encode(msg)
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        async with self._send_lock:
            if size <= _COALESCE_BYTES:
                # A decode step's activations are a few KiB: copying them is cheaper than two more writes.
                await self.stream.send_all(b"".join((_LEN.pack(len(header)), header, _LEN.pack(size), payload)))
            else:
                await self._send_frame_locked(header)
                await self._send_frame_locked(payload)

    async def receive_payload(self, meta: TensorMeta) -> bytes:
        """The raw frame that follows a message carrying `meta`; its length must match the meta exactly."""
        expected = meta.nbytes()
        if expected > self.max_tensor_frame:
            raise FrameTooLarge(f"tensor of {expected} bytes is over the limit of {self.max_tensor_frame}")
        frame = await self.receive_frame(limit=self.max_tensor_frame)
        if frame is None:
            raise ProtocolError("stream ended before the tensor payload")
        if len(frame) != expected:
            raise ProtocolError(f"tensor payload has {len(frame)} bytes, header says {expected} "
                                f"({meta.dtype}{list(meta.shape)})")
        return frame

    # -- failure ----------------------------------------------------------------------------------------

    async def reject(self, code: str, message: str, *, linger_s: float = 1.0) -> None:
        """Tell the peer what was wrong, then reset the stream. Never raises.

        A reset discards data the peer has not read yet (yamux does this too), so after the reply we close our
        side and wait, bounded in time and bytes, for the peer to read it and close or reset its own side."""
        try:
            with trio.move_on_after(linger_s):
                await self.send_msg(ErrorReply(code=code, message=message[:1000]))
                await self.stream.close()
                drained = 0
                while drained < _LINGER_DRAIN_BYTES:
                    chunk = await self.stream.receive_some(_RECV_CHUNK)
                    if not chunk:
                        break
                    drained += len(chunk)
        except Exception:  # the peer may be gone already; the reset below is what matters
            log.debug("could not deliver error reply", exc_info=True)
        try:
            await self.stream.reset()
        except Exception:
            log.debug("reset after error reply failed", exc_info=True)

    async def aclose(self) -> None:
        try:
            await self.stream.close()
        except Exception:
            log.debug("close failed", exc_info=True)
