"""An idle keep-alive connection outlives the clients' own expiry (httpx and the SDKs drop theirs after
5 s): a server closing at the same moment would reset the client's next request on it. Nor does a
500 close the connection it was sent on."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

from conftest import API_KEY


def test_an_idle_connection_still_serves_after_the_clients_expiry(server):
    url = urlparse(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().read() and conn.sock is not None
    sock = conn.sock
    time.sleep(6)  # past uvicorn's default 5 s keep-alive, which closed the connection here
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200 and conn.sock is sock  # the same connection answered


def test_a_500_leaves_its_connection_serving(server, monkeypatch):
    """An unhandled error is answered with a 500 in the API's shape, and the connection stays open:
    uvicorn closed it when the error was re-raised to it, under a client already reusing it."""
    from dwarfstar.serving import openai_chat

    def broken(*args, **kwargs):
        raise RuntimeError("writer construction failed")

    monkeypatch.setattr(openai_chat, "ChatStream", broken)
    url = urlparse(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
    response = conn.getresponse()
    assert response.status == 500
    assert json.loads(response.read())["error"]["message"] == "internal server error: RuntimeError"
    sock = conn.sock
    time.sleep(0.5)  # time for the server to close the connection, as it did
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200 and conn.sock is sock
