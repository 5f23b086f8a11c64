"""An idle keep-alive connection outlives the clients' own expiry (httpx and the SDKs drop theirs after
5 s): a server closing at the same moment would reset the client's next request on it."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlparse


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
