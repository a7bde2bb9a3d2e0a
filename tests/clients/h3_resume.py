"""QUIC session resumption across two servers with aioquic: connect to the first,
GET PATH, keep the newest session ticket it sends; connect to the second offering
that ticket, GET PATH again. Prints one JSON line: each connection's status and
whether it resumed, and whether the ticket offered early data (0-RTT).

usage: h3_resume.py HOST PORT_FIRST PORT_SECOND SNI PATH CAFILE
"""

import asyncio
import json
import sys

from aioquic.asyncio.client import connect
from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from h3_fetch import Client  # noqa: E402  (the same H3 client as h3_fetch.py)


async def fetch(host, port, sni, path, cafile, ticket):
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=sni)
    config.load_verify_locations(cafile)
    config.session_ticket = ticket
    tickets = []
    async with connect(
        host,
        int(port),
        configuration=config,
        create_protocol=Client,
        session_ticket_handler=tickets.append,
        wait_connected=True,
    ) as client:
        state = await client.get(f"{sni}:{port}", path, [])
        resumed = client._quic.tls.session_resumed
        # The tickets come right after the handshake; the response came later.
    status = dict(state["headers"]).get(b":status", b"").decode()
    return status, resumed, tickets


async def main():
    host, first, second, sni, path, cafile = sys.argv[1:7]
    s1, r1, tickets = await asyncio.wait_for(fetch(host, first, sni, path, cafile, None), 30)
    if not tickets:
        print(json.dumps({"error": "no session ticket from the first server"}))
        return
    ticket = tickets[-1]
    s2, r2, _ = await asyncio.wait_for(fetch(host, second, sni, path, cafile, ticket), 30)
    print(
        json.dumps(
            {
                "first": {"status": s1, "resumed": r1},
                "second": {"status": s2, "resumed": r2},
                "early_data": ticket.max_early_data_size,
            }
        )
    )


asyncio.run(main())
