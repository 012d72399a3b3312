#!/usr/bin/env python3
"""A WebSocket client of gpuvisor's event stream that is not gpuvisor's own code.

Usage: events_client.py SOCKET [TYPE...]

Connects to the agent's Unix socket with the `websockets` library, subscribes with
`events.subscribe` (JSON-RPC 2.0), prints "subscribed <id>" once the agent answers, then
every event (the `result` of each `events.event` notification) as one JSON line, flushed.
Exits 0 when the agent closes the connection.
"""
import asyncio
import json
import sys

from websockets.asyncio.client import unix_connect
from websockets.exceptions import ConnectionClosed


async def main(socket, types):
    async with unix_connect(socket, "ws://gpuvisor/") as ws:
        params = {"types": types} if types else {}
        await ws.send(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "events.subscribe", "params": params}))
        try:
            async for raw in ws:
                msg = json.loads(raw)
                if msg.get("id") == 1:
                    if "error" in msg:
                        print("error " + json.dumps(msg["error"]), flush=True)
                        return 1
                    print("subscribed " + str(msg["result"]), flush=True)
                elif msg.get("method") == "events.event":
                    print(json.dumps(msg["params"]["result"]), flush=True)
        except ConnectionClosed:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1], sys.argv[2:])))
