"""One-shot probes the launcher polls to learn that a shard has loaded and that the router serves."""
import os
import urllib.request

import grpc

from proto import generate_pb2, generate_pb2_grpc
from router.shards import target

# No proxy: the router listens on this machine, and an http_proxy in the environment must not intercept.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def shard_healthy(address: str, timeout: float = 2.0) -> bool:
    """Whether the shard at `address` (a socket's path, or host:port) answers Health, which it does once its
    weights are loaded."""
    if address.startswith("/") and not os.path.exists(address):
        return False
    # A fresh channel per probe: a long-lived one backs off reconnecting (up to minutes) while a shard
    # loads, and would keep answering UNAVAILABLE after the socket appears.
    with grpc.insecure_channel(target(address)) as channel:
        try:
            generate_pb2_grpc.ShardStub(channel).Health(generate_pb2.HealthRequest(), timeout=timeout)
            return True
        except grpc.RpcError:
            return False


def router_url(hostname: str, port: int) -> str:
    """The address to reach a router listening on hostname: a wildcard address is reached via loopback."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(hostname, hostname)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def router_healthy(url: str, timeout: float = 2.0) -> bool:
    """Whether GET /health answers 200, which it does once the shards are warmed up."""
    try:
        with _opener.open(f"{url}/health", timeout=timeout) as response:
            return response.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status such as 503
        return False
