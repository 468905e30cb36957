"""Half-sent requests are timed out and never hold up anyone else: a head that stalls loses its connection, a
body that stalls gets a 408 in TGI's error shape."""
import json
import socket
import time

import httpx

from conftest import BODY_TIMEOUT, HEAD_TIMEOUT, assert_idle


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=BODY_TIMEOUT + 30)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (reads until EOF; the socket's timeout bounds the wait)."""
    try:
        while sock.recv(65536):
            pass
        return True
    except (ConnectionResetError, socket.timeout):
        return False


def response(sock: socket.socket) -> tuple[str, bytes]:
    """One HTTP response's head and its Content-Length body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, payload = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(payload) < length:
        payload += sock.recv(65536)
    return head.decode(), payload


def test_stalled_heads_and_bodies_are_timed_out_while_others_are_served(server):
    heads = [connect(server) for _ in range(50)]
    for sock in heads:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    body = connect(server)
    body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"inputs\": ")
    began = time.monotonic()
    ok = httpx.post(f"{server.url}/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 2}},
                    timeout=60)
    assert ok.status_code == 200
    assert all(closed(sock) for sock in heads)
    assert time.monotonic() - began < HEAD_TIMEOUT + 20
    head, payload = response(body)
    assert head.startswith("HTTP/1.1 408"), head
    assert json.loads(payload) == {"error": f"Request timeout: the body did not arrive within {BODY_TIMEOUT} s",
                                   "error_type": "timeout"}
    assert time.monotonic() - began < BODY_TIMEOUT + 20
    assert_idle(server.url)
