"""Fetch one URL over HTTP/3 with aioquic, an independent QUIC/H3 implementation.

Prints one JSON line: status, headers, body length and SHA-256. The body is hashed
as it arrives and never kept, so a 100 MB download needs no memory.

usage: h3_fetch.py HOST PORT SNI PATH CAFILE [HEADER:VALUE ...]
"""

import asyncio
import hashlib
import json
import sys

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.streams = {}

    def quic_event_received(self, event):
        for ev in self.h3.handle_event(event):
            state = self.streams.get(getattr(ev, "stream_id", None))
            if state is None:
                continue
            if isinstance(ev, HeadersReceived):
                state["headers"].extend(ev.headers)
            elif isinstance(ev, DataReceived):
                state["sha"].update(ev.data)
                state["len"] += len(ev.data)
            if getattr(ev, "stream_ended", False) and not state["done"].done():
                state["done"].set_result(True)

    async def get(self, authority, path, extra):
        stream_id = self._quic.get_next_available_stream_id()
        headers = [
            (b":method", b"GET"),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ] + extra
        state = {
            "headers": [],
            "sha": hashlib.sha256(),
            "len": 0,
            "done": asyncio.get_running_loop().create_future(),
        }
        self.streams[stream_id] = state
        self.h3.send_headers(stream_id, headers, end_stream=True)
        self.transmit()
        await asyncio.wait_for(state["done"], 300)
        return state


async def main():
    host, port, sni, path, cafile = sys.argv[1:6]
    extra = []
    for item in sys.argv[6:]:
        name, value = item.split(":", 1)
        extra.append((name.strip().lower().encode(), value.strip().encode()))
    config = QuicConfiguration(
        is_client=True,
        alpn_protocols=H3_ALPN,
        server_name=sni,
        max_data=64 << 20,
        max_stream_data=16 << 20,
    )
    config.load_verify_locations(cafile)
    async with connect(host, int(port), configuration=config, create_protocol=Client) as client:
        state = await client.get(f"{sni}:{port}", path, extra)
    headers = {k.decode(): v.decode() for k, v in state["headers"]}
    print(
        json.dumps(
            {
                "status": int(headers.get(":status", "0")),
                "headers": headers,
                "len": state["len"],
                "sha256": state["sha"].hexdigest(),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
