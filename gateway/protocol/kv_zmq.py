"""vLLM's KV-cache events as its ZMQ publisher sends them, turned into ours (`kv_blocks`).

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:PORT"}'` (a bind address: with `tcp://host:PORT` vLLM
connects out instead, and its events are lost) publishes on a ZMQ PUB socket one
multipart message per scheduler step that changed its cache: a topic, an 8-byte
big-endian sequence number (from 0), and a msgpack payload `[timestamp, [event, ...],
data_parallel_rank]`, each event a map tagged by `type`: `BlockStored` (block_hashes,
parent_block_hash, token_ids, block_size, medium, lora_name, extra_keys, group_idx,
locality, ...), `BlockRemoved` (block_hashes, medium, ...), `AllBlocksCleared`
(vllm/distributed/kv_events.py). vLLM's OpenAI HTTP server publishes so, and so does the
engine inside our worker's `--engine vllm`: the gateway's `openai` upstreams and the
worker both read it with `ZmqKvSubscriber`, which is why this lives in the protocol.

Kept, as `gateway.upstreams.vllm_kv` keeps from vLLM's gRPC relay: blocks on the
engine's own device (`medium` GPU or unset), local, of the first KV-cache group, of the
base model with no extra hash keys (a LoRA adapter's, an image's, a salted prompt's
blocks hash under a namespace the gateway does not compute); removals; a cleared cache.
Block hashes are bytes (vLLM's default) or ints; both are folded to their low 64 bits,
signed, as the worker protocol carries them. No snapshot and no load record travel on
this wire: a subscriber learns the blocks stored after it subscribed.

Sequence numbers: the first batch of a subscription says `reset`; a number at or below
the last one means the publisher restarted (or lies): `reset` too. A lost connection
(the engine stopped, or a frame was refused) yields an empty `reset` batch at once, so
the index stops counting on blocks a restarted engine no longer holds. A gap (messages ZMQ
dropped past its high-water mark, or refused here) is left to the index, which drops
the worker's part and follows the live events from there, unless the publisher has a
replay socket (vLLM's `replay_endpoint`, a ROUTER that sends back the batches it still
keeps, `buffer_steps` of them, from a sequence number on): given one, the subscriber asks
it for everything each time it connects (so a gateway started
after its engines, or one whose engine restarted, learns the blocks stored before it
listened, as far as the publisher's buffer reaches), and for the missed numbers on a gap
(at most one replay every `REPLAY_WAIT` seconds: a publisher that always skips numbers
costs a reset, not a replay each message). Live messages the replay already brought
are skipped.

Bounds, since whatever answers at the endpoint is not trusted: a frame over
`MAX_MESSAGE_BYTES` makes libzmq drop the connection (ZMQ_MAXMSGSIZE; the subscriber
then connects again itself, as libzmq does not after such a refusal), at most
`RECEIVE_QUEUE` messages wait in the socket, a payload is unpacked under msgpack's
limits on arrays, maps, strings and binaries, and a message of another shape is refused
whole: counted in `malformed`, logged at most once a minute, its sequence number skipped
(a gap for the index). A replay brings at most `MAX_REPLAY` messages, each waited for
at most `REPLAY_WAIT` seconds, under the same frame bound; past either it is given up
(logged) and the live stream goes on.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from gateway.protocol.kv_blocks import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    KvBatch,
    KvEvent,
)

log = logging.getLogger("furnace.kv.zmq")

#: Bytes of one frame at most (a step's events are kilobytes to a few hundred).
MAX_MESSAGE_BYTES = 8 << 20
#: Messages waiting in the socket at most (ZMQ_RCVHWM); past it ZMQ drops, a gap.
RECEIVE_QUEUE = 256
#: Items of one msgpack array at most: token ids of a batch, events of a batch.
MAX_ARRAY = 1 << 20
#: Seconds between two warnings about one endpoint.
WARN_EVERY = 60.0
#: Messages one replay brings at most (vLLM keeps 10,000 steps by default).
MAX_REPLAY = 16_384
#: Seconds a replay waits for its next message; also the least time between two.
REPLAY_WAIT = 5.0
#: The sequence number of vLLM's end-of-replay marker.
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_LIMITS: dict[str, Any] = {
    "max_str_len": 1024,
    "max_bin_len": 1024,
    "max_array_len": MAX_ARRAY,
    "max_map_len": 64,
    "max_ext_len": 0,
}
_DEVICE = (None, "GPU")
_TOKEN_MAX = (1 << 32) - 1


class Malformed(ValueError):
    """A message that is not one of vLLM's event batches."""


def _hash(value: object) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value[-8:], "big", signed=True)
    if isinstance(value, int) and not isinstance(value, bool):
        return ((value + (1 << 63)) % (1 << 64)) - (1 << 63)
    raise Malformed(f"a block hash of type {type(value).__name__}")


def _hashes(value: object) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise Malformed("block_hashes is not a list")
    return tuple(_hash(v) for v in value)


def _local(event: dict[str, Any]) -> bool:
    return (
        event.get("medium") in _DEVICE
        and event.get("locality") in (None, "LOCAL")
        and event.get("group_idx") in (None, 0)
    )


def _stored(event: dict[str, Any]) -> BlocksStored | None:
    extra = event.get("extra_keys")
    if extra is not None and not isinstance(extra, list):
        raise Malformed("extra_keys is not a list")
    if (
        not _local(event)
        or event.get("lora_name")
        or event.get("lora_id") is not None
        or any(key is not None for key in extra or ())
    ):
        return None
    tokens, size, parent = event.get("token_ids"), event.get("block_size"), None
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise Malformed("token_ids is not a list of ints")
    if tokens and not (min(tokens) >= 0 and max(tokens) <= _TOKEN_MAX):
        raise Malformed("a token id out of range")
    if type(size) is not int or not 0 < size <= _TOKEN_MAX:
        raise Malformed("block_size is not a positive int")
    if event.get("parent_block_hash") is not None:
        parent = _hash(event["parent_block_hash"])
    return BlocksStored(_hashes(event.get("block_hashes")), parent, tokens, size)


def _event(raw: object) -> KvEvent | None:
    if not isinstance(raw, dict):
        raise Malformed("an event that is not a map")
    kind = raw.get("type")
    if kind == "BlockStored":
        return _stored(raw)
    if kind == "BlockRemoved":
        return BlocksRemoved(_hashes(raw.get("block_hashes"))) if _local(raw) else None
    if kind == "AllBlocksCleared":
        return CacheCleared()
    if not isinstance(kind, str):
        raise Malformed("an event without a type")
    return None  # a kind of a later vLLM: nothing the index knows of


def decode(frames: Sequence[bytes]) -> tuple[int, float, tuple[KvEvent, ...]]:
    """One message's sequence number, time stamp and events; `Malformed` when the
    frames are not (topic, 8-byte sequence, msgpack batch)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise Malformed(f"{len(frames)} frames, not topic, sequence and payload")
    sequence = int.from_bytes(frames[1], "big")
    try:
        payload = msgpack.unpackb(frames[2], **_LIMITS)
    except (ValueError, msgpack.UnpackException) as error:
        raise Malformed(f"not msgpack within bounds ({type(error).__name__})") from None
    if not isinstance(payload, list) or len(payload) < 2 or not isinstance(payload[1], list):
        raise Malformed("a payload that is not [timestamp, [events], ...]")
    stamp = payload[0]
    if not isinstance(stamp, int | float) or isinstance(stamp, bool) or not math.isfinite(stamp):
        stamp = 0.0
    try:
        events = tuple(e for raw in payload[1] if (e := _event(raw)) is not None)
    except Malformed:
        raise
    except (TypeError, ValueError) as error:  # a shape the checks above did not foresee
        raise Malformed(f"an event of another shape ({error})") from None
    return sequence, float(stamp), events


class ZmqKvSubscriber:
    """Follows one vLLM publisher at `endpoint` (`tcp://host:port`), asking its replay
    socket at `replay` (when given) for what it missed: `batches()`."""

    def __init__(self, endpoint: str, replay: str | None = None) -> None:
        self.endpoint = endpoint
        self.replay = replay
        #: Messages refused (not a batch, past a bound), since this object was made.
        self.malformed = 0
        #: Whether the publisher is connected now (False until it first is).
        self.connected = False
        #: Replays that ran to their end, and the batches they brought.
        self.replays = 0
        self.replayed = 0
        self._warned_at = -WARN_EVERY
        self._replayed_at = -REPLAY_WAIT

    async def batches(self) -> AsyncGenerator[KvBatch]:
        """The publisher's batches as they come, until closed (ZMQ reconnects by
        itself: the stream never ends on its own)."""
        socket, monitor, poller = self._subscribe()
        try:
            last: int | None = None
            #: The last number a replay brought: live messages up to it are not new.
            replayed: int | None = None
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())["event"]
                    self.connected = event == zmq.EVENT_CONNECTED
                    if event == zmq.EVENT_DISCONNECTED:
                        # a socket of its own for the next connection: libzmq does not
                        # connect again by itself after it refused a frame, and reading a
                        # socket after zmq_disconnect can abort the process (libzmq
                        # #2163: a message whose pipe went mid-read asserts in fq.cpp)
                        _close(socket, monitor)
                        socket, monitor, poller = self._subscribe()
                        if last is not None:  # the engine may be gone, or its messages lost
                            yield KvBatch(last, (), True)
                            last = replayed = None
                    elif self.replay is not None:  # connected: what the engine kept so far
                        async for batch in self._replay(0, last):
                            last = replayed = batch.sequence
                            yield batch
                if socket not in ready:
                    continue
                frames = await socket.recv_multipart()
                self.connected = True  # whatever the monitor has told yet
                try:
                    sequence, stamp, events = decode(frames)
                except Malformed as error:
                    self._refused(str(error))
                    continue
                if replayed is not None:
                    if sequence <= replayed:
                        continue  # a replay brought it
                    replayed = None
                if last is not None and sequence > last + 1 and self._may_replay():
                    self._replayed_at = time.monotonic()
                    async for batch in self._replay(last + 1, last):
                        last = replayed = batch.sequence
                        yield batch
                    if sequence <= last:
                        continue
                reset = last is None or sequence <= last
                last = sequence
                yield KvBatch(sequence, events, reset, None, stamp)
        finally:
            self.connected = False
            _close(socket, monitor)

    def _subscribe(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket, zmq.asyncio.Poller]:
        """A SUB socket connecting to the publisher, bounded, its monitor, and a poller
        of both."""
        socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        except BaseException:
            socket.close(linger=0)
            raise
        try:
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(self.endpoint)
        except BaseException:  # a bad endpoint: neither socket is left to the collector
            _close(socket, monitor)
            raise
        poller = zmq.asyncio.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        return socket, monitor, poller

    def _may_replay(self) -> bool:
        """A gap's replay: given a socket, and none in the last `REPLAY_WAIT` seconds."""
        return self.replay is not None and time.monotonic() - self._replayed_at >= REPLAY_WAIT

    async def _replay(self, start: int, last: int | None) -> AsyncGenerator[KvBatch]:
        """The batches the publisher kept from number `start` on, in order, each saying
        `reset` as a live one would after `last`; nothing past the bounds."""
        assert self.replay is not None
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.replay)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(MAX_REPLAY):
                if not await dealer.poll(REPLAY_WAIT * 1000):
                    self._warn(f"no replay from {self.replay} within {REPLAY_WAIT:g} s")
                    return
                frames = await dealer.recv_multipart()
                if len(frames) == 4 and frames[2] == _END_OF_REPLAY:
                    self.replays += 1
                    return
                try:
                    sequence, stamp, events = decode(frames[1:])
                except Malformed as error:
                    self._refused(f"in a replay: {error}")
                    continue
                if last is not None and start <= sequence <= last:
                    continue  # already applied (a replay from 0 after a reconnection)
                self.replayed += 1
                yield KvBatch(sequence, events, last is None or sequence <= last, None, stamp)
                last = sequence
            self._warn(f"a replay from {self.replay} past {MAX_REPLAY} messages: cut")
        finally:
            dealer.close(linger=0)

    def _refused(self, why: str) -> None:
        self.malformed += 1
        self._warn(f"a message refused: {why}")

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY:
            self._warned_at = now
            log.warning("KV events from %s: %s", self.endpoint, what)


def _close(socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
    socket.disable_monitor()
    monitor.close(linger=0)
    socket.close(linger=0)
