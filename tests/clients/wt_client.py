"""WebTransport (draft-02 over HTTP/3) with aioquic, an independent implementation.

Drives Webship's diagnostic endpoint and prints one JSON line of what it saw.

usage: wt_client.py HOST PORT SNI PATH CAFILE ORIGIN SCENARIO [ARGS ...]

scenarios:
  echo BYTES DATAGRAMS      a bidi and a uni stream of BYTES pattern bytes each, and
                            DATAGRAMS datagrams; reports what came back
  source BYTES              `stream BYTES` on a bidi stream: length and SHA-256
  source-datagrams N SIZE   `datagrams N SIZE`: how many arrived
  sink BYTES DATAGRAMS      sends both, then reads the session's totals
  streams N                 opens N bidi streams and keeps them open
  datagram SIZE             sends one datagram of SIZE bytes
  flood N                   sends N small datagrams at once
  idle                      opens a session and sends nothing
  churn N                   N sessions in turn, each on its own connection, echoing
                            one stream and closing cleanly
  echo-loop SECS            a datagram and a stream echoed every 100 ms for SECS seconds
                            or until the session ends; counts echoes before and after
                            the server's DRAIN_WEBTRANSPORT_SESSION, and failures

Whenever the server ends the session its CLOSE_WEBTRANSPORT_SESSION code and reason
are reported as close_code / close_reason.
"""

import asyncio
import hashlib
import json
import os
import struct
import sys
import time

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import (
    DataReceived,
    DatagramReceived,
    HeadersReceived,
    WebTransportStreamDataReceived,
)
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import StreamDataReceived, StreamReset

CLOSE_SESSION = 0x2843
DRAIN_SESSION = 0x78AE
DEADLINE = 300


def read_varint(buf, at):
    first = buf[at]
    length = 1 << (first >> 6)
    if len(buf) < at + length:
        return None, at
    value = first & 0x3F
    for b in buf[at + 1 : at + length]:
        value = (value << 8) | b
    return value, at + length


def encode_varint(v):
    if v < 1 << 6:
        return bytes([v])
    if v < 1 << 14:
        return struct.pack(">H", 0x4000 | v)
    if v < 1 << 30:
        return struct.pack(">I", 0x80000000 | v)
    return struct.pack(">Q", 0xC000000000000000 | v)


def pattern(n):
    """The server's source pattern (xorshift64*), which is also the fixture."""
    out = bytearray()
    s = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1
    while len(out) < n:
        s ^= s >> 12
        s ^= (s << 25) & mask
        s ^= s >> 27
        out += struct.pack("<Q", (s * 0x2545F4914F6CDD1D) & mask)
    return bytes(out[:n])


class Stream:
    def __init__(self):
        self.sha = hashlib.sha256()
        self.len = 0
        self.data = bytearray()
        self.keep = True
        self.ended = asyncio.get_running_loop().create_future()
        self.reset = None

    def feed(self, data, ended):
        self.sha.update(data)
        self.len += len(data)
        if self.keep and self.len <= 1 << 20:
            self.data += data
        if ended and not self.ended.done():
            self.ended.set_result(True)


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic, enable_webtransport=True)
        self.session = None
        self.session_reset = None
        self.status = None
        self.headers_done = None
        self.capsules = bytearray()
        self.close_info = None
        self.capsule_kinds = []
        self.drain_at = None
        self.closed = None
        self.streams = {}
        self.datagrams = []
        self.new_uni = None
        self.local_bidi = set()

    def quic_event_received(self, event):
        # aioquic 1.7 parses what arrives on a bidi stream *we* opened as HTTP/3
        # frames; on a WebTransport stream it is raw data, so take it here.
        if isinstance(event, StreamDataReceived) and event.stream_id in self.local_bidi:
            self.streams[event.stream_id].feed(event.data, event.end_stream)
            return
        if isinstance(event, StreamReset):
            if event.stream_id == self.session:
                self.session_reset = event.error_code
            st = self.streams.get(event.stream_id)
            if st is not None:
                st.reset = event.error_code
                if not st.ended.done():
                    st.ended.set_result(False)
        for ev in self.h3.handle_event(event):
            if isinstance(ev, HeadersReceived) and ev.stream_id == self.session:
                for k, v in ev.headers:
                    if k == b":status":
                        self.status = int(v)
                if not self.headers_done.done():
                    self.headers_done.set_result(True)
                if ev.stream_ended and not self.closed.done():
                    self.closed.set_result(True)
            elif isinstance(ev, DataReceived) and ev.stream_id == self.session:
                self.capsules += ev.data
                self.parse_capsules()
                if ev.stream_ended and not self.closed.done():
                    self.closed.set_result(True)
            elif isinstance(ev, WebTransportStreamDataReceived):
                st = self.streams.get(ev.stream_id)
                if st is None:
                    st = self.streams[ev.stream_id] = Stream()
                    if self.new_uni is not None and not self.new_uni.done():
                        self.new_uni.set_result(ev.stream_id)
                st.feed(ev.data, ev.stream_ended)
            elif isinstance(ev, DatagramReceived):
                self.datagrams.append(ev.data)

    def parse_capsules(self):
        while self.capsules:
            kind, at = read_varint(self.capsules, 0)
            if kind is None:
                return
            length, at2 = read_varint(self.capsules, at)
            if length is None or len(self.capsules) < at2 + length:
                return
            payload = bytes(self.capsules[at2 : at2 + length])
            del self.capsules[: at2 + length]
            self.capsule_kinds.append(kind)
            if kind == DRAIN_SESSION and self.drain_at is None:
                self.drain_at = time.monotonic()
            if kind == CLOSE_SESSION:
                code = struct.unpack(">I", payload[:4])[0]
                self.close_info = (code, payload[4:].decode())

    async def open_session(self, authority, path, origin):
        loop = asyncio.get_running_loop()
        self.headers_done = loop.create_future()
        self.closed = loop.create_future()
        self.session = self._quic.get_next_available_stream_id()
        headers = [
            (b":method", b"CONNECT"),
            (b":protocol", b"webtransport"),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
            (b"sec-webtransport-http3-draft02", b"1"),
        ]
        if origin != "-":
            headers.append((b"origin", origin.encode()))
        self.h3.send_headers(self.session, headers, end_stream=False)
        self.transmit()
        await asyncio.wait_for(self.headers_done, 20)
        return self.status

    def open_stream(self, uni=False):
        sid = self.h3.create_webtransport_stream(self.session, is_unidirectional=uni)
        if not uni:
            self.streams[sid] = Stream()
            self.local_bidi.add(sid)
        return sid

    async def send(self, sid, data, end):
        # In slices, yielding so flow control and the event loop keep up.
        step = 256 * 1024
        for at in range(0, len(data), step):
            self._quic.send_stream_data(sid, data[at : at + step], False)
            self.transmit()
            await asyncio.sleep(0)
        self._quic.send_stream_data(sid, b"", end)
        self.transmit()

    def datagram(self, payload):
        self.h3.send_datagram(self.session, payload)
        self.transmit()

    def close_session(self, code=0, reason=b"done"):
        payload = struct.pack(">I", code) + reason
        capsule = encode_varint(CLOSE_SESSION) + encode_varint(len(payload)) + payload
        self.h3.send_data(self.session, capsule, end_stream=True)
        self.transmit()

    async def session_closed(self, seconds):
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), seconds)
        except asyncio.TimeoutError:
            pass


def config(sni, cafile):
    c = QuicConfiguration(
        is_client=True,
        alpn_protocols=H3_ALPN,
        server_name=sni,
        max_data=64 << 20,
        max_stream_data=16 << 20,
        max_datagram_frame_size=65536,
    )
    c.load_verify_locations(cafile)
    return c


async def scenario(client, name, args, out):
    if name == "echo":
        size, count = int(args[0]), int(args[1])
        data = os.urandom(size)
        bidi = client.open_stream()
        await client.send(bidi, data, True)
        await asyncio.wait_for(client.streams[bidi].ended, DEADLINE)
        out["bidi_len"] = client.streams[bidi].len
        out["bidi_equal"] = client.streams[bidi].sha.digest() == hashlib.sha256(data).digest()
        client.new_uni = asyncio.get_running_loop().create_future()
        uni = client.open_stream(uni=True)
        await client.send(uni, data, True)
        back = await asyncio.wait_for(client.new_uni, 20)
        await asyncio.wait_for(client.streams[back].ended, DEADLINE)
        out["uni_len"] = client.streams[back].len
        out["uni_equal"] = client.streams[back].sha.digest() == hashlib.sha256(data).digest()
        sent = [struct.pack(">Q", i) + os.urandom(992) for i in range(count)]
        for d in sent:
            client.datagram(d)
            await asyncio.sleep(0.001)
        await asyncio.sleep(1.0)
        wanted = set(sent)
        out["datagrams_sent"] = count
        out["datagrams_back"] = sum(1 for d in client.datagrams if d in wanted)
    elif name == "source":
        size = int(args[0])
        sid = client.open_stream()
        client.streams[sid].keep = False
        await client.send(sid, f"stream {size}\n".encode(), True)
        start = time.monotonic()
        await asyncio.wait_for(client.streams[sid].ended, DEADLINE)
        secs = time.monotonic() - start
        out["len"] = client.streams[sid].len
        out["sha256"] = client.streams[sid].sha.hexdigest()
        out["mib_per_s"] = round(client.streams[sid].len / secs / 1048576, 1)
    elif name == "source-datagrams":
        count, size = int(args[0]), int(args[1])
        sid = client.open_stream()
        await client.send(sid, f"datagrams {count} {size}\n".encode(), True)
        await asyncio.wait_for(client.streams[sid].ended, DEADLINE)
        out["reply"] = bytes(client.streams[sid].data).decode().strip()
        await asyncio.sleep(0.5)
        seqs = {struct.unpack(">Q", d[:8])[0] for d in client.datagrams if len(d) == size}
        out["datagrams_received"] = len(seqs)
        expect = pattern(size - 8)
        out["first_payload_ok"] = any(d[8:] == expect for d in client.datagrams if d[:8] == bytes(8))
    elif name == "sink":
        size, count = int(args[0]), int(args[1])
        sid = client.open_stream()
        await client.send(sid, os.urandom(size), True)
        await asyncio.wait_for(client.streams[sid].ended, DEADLINE)
        for i in range(count):
            client.datagram(struct.pack(">Q", i) + bytes(100))
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.5)
        totals = client.open_stream()
        await client.send(totals, b"", True)
        await asyncio.wait_for(client.streams[totals].ended, 20)
        out["totals"] = json.loads(bytes(client.streams[totals].data))
    elif name == "streams":
        for _ in range(int(args[0])):
            sid = client.open_stream()
            await client.send(sid, b"x", False)
        await client.session_closed(10)
    elif name == "datagram":
        client.datagram(bytes(int(args[0])))
        await client.session_closed(10)
    elif name == "flood":
        for i in range(int(args[0])):
            client.datagram(struct.pack(">Q", i))
        await client.session_closed(10)
    elif name == "idle":
        await client.session_closed(30)
    elif name == "echo-loop":
        end = time.monotonic() + float(args[0])
        before = after = failed = refused = datagrams_after = 0
        i = 0
        while time.monotonic() < end and not client.closed.done():
            i += 1
            draining = client.drain_at is not None
            # A datagram every turn: still echoed while the session drains.
            probe = struct.pack(">Q", i) + b"probe"
            client.datagram(probe)
            data = f"ping {i}".encode()
            sid = client.open_stream()
            await client.send(sid, data, True)
            try:
                await asyncio.wait_for(asyncio.shield(client.streams[sid].ended), 5)
                ok = bytes(client.streams[sid].data) == data
            except asyncio.TimeoutError:
                ok = False
            await asyncio.sleep(0.1)
            if draining and probe in client.datagrams:
                datagrams_after += 1
            if ok and not draining:
                before += 1
            elif ok:
                after += 1
            elif draining or client.drain_at is not None:
                refused += 1  # a draining session admits no new streams
            else:
                failed += 1
        out["echoes_before_drain"] = before
        out["echoes_after_drain"] = after
        out["streams_refused_while_draining"] = refused
        out["datagrams_echoed_while_draining"] = datagrams_after
        out["echoes_failed"] = failed
    elif name == "bad-command":
        sid = client.open_stream()
        await client.send(sid, b"make coffee\n", True)
        await client.session_closed(10)
    else:
        raise SystemExit(f"unknown scenario {name}")
    if name in ("echo", "source", "source-datagrams", "sink") and not client.closed.done():
        await asyncio.sleep(0.1)  # a close capsule from the server may be on its way
        if client.close_info is None:
            client.close_session()
            await client.session_closed(5)


async def main():
    host, port, sni, path, cafile, origin, name = sys.argv[1:8]
    args = sys.argv[8:]
    authority = f"{sni}:{port}"
    out = {}
    if name == "churn":
        ok = 0
        for _ in range(int(args[0])):
            async with connect(host, int(port), configuration=config(sni, cafile), create_protocol=Client) as client:
                if await client.open_session(authority, path, origin) != 200:
                    break
                sid = client.open_stream()
                await client.send(sid, b"ping", True)
                await asyncio.wait_for(client.streams[sid].ended, 20)
                if bytes(client.streams[sid].data) == b"ping":
                    ok += 1
                client.close_session()
                await client.session_closed(5)
        out["sessions_ok"] = ok
        print(json.dumps(out))
        return
    async with connect(host, int(port), configuration=config(sni, cafile), create_protocol=Client) as client:
        out["status"] = await client.open_session(authority, path, origin)
        if out["status"] == 200:
            await scenario(client, name, args, out)
        else:
            # A refusal is a whole response: its stream ends (FIN), it is not reset.
            try:
                await asyncio.wait_for(asyncio.shield(client.closed), 2)
            except asyncio.TimeoutError:
                pass
            out["session_ended"] = client.closed.done()
            if client.session_reset is not None:
                out["session_reset"] = client.session_reset
        out["drained"] = DRAIN_SESSION in client.capsule_kinds
        if client.close_info is not None:
            out["close_code"], out["close_reason"] = client.close_info
        resets = [s.reset for s in client.streams.values() if s.reset is not None]
        if resets:
            out["stream_resets"] = resets
    print(json.dumps(out))


asyncio.run(main())
