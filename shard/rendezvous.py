"""How the ranks of one tensor-parallel set meet, on one machine or across several.

On one machine the ranks meet through a file (no port is opened) and gloo's and NCCL's sockets bind the loopback
interface. Across machines (`--nnodes` > 1) node 0's launcher hosts a torch.distributed TCPStore at
--master-addr:--master-port; every rank meets there, the collectives bind the interface that reaches that address,
and a rank on another node serves its gRPC on that interface's address (a port the system picks), which it
publishes in the store for node 0's router. Nothing authenticates: that network must be trusted, as gloo and NCCL
assume. A rank on another node watches the store: when node 0's launcher is gone, so is the store, and the rank
exits 1 at once rather than wait for a step that will never come.
"""
import logging
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

LOOPBACK = "lo"  # Linux's loopback interface
JOIN_TIMEOUT = 600.0  # s a rank waits for the store and for every other rank to join (the nodes' launchers may
                      # start minutes apart), and a collective may take
WATCH_EVERY = 1.0     # s between a remote rank's looks at node 0's store
log = logging.getLogger("shard")


def address_key(rank: int) -> str:
    return f"cb/shard/{rank}"


def split(url: str) -> tuple[str, int]:
    """`tcp://host:port` (an IPv6 host in brackets) as (host, port)."""
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to host (a UDP socket's connect sends nothing)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address`."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    raise RuntimeError(f"no network interface holds {address}")


def connect(url: str, timeout: float = JOIN_TIMEOUT) -> dist.TCPStore:
    """A client of the store node 0's launcher hosts at `url`."""
    host, port = split(url)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def init_process_group(rank: int, world: int, rendezvous: str, device: torch.device) -> dist.Store | None:
    """Joins the set through `rendezvous`: a file path (one machine), or node 0's store as tcp://host:port, which it
    returns. gloo's and NCCL's sockets bind the interface that reaches the store (loopback on one machine) unless
    the user chose one."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not rendezvous.startswith("tcp://"):
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, LOOPBACK)
        dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
        return None
    interface = interface_of(route_address(*split(rendezvous)))
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, interface)
    store = connect(rendezvous)
    dist.init_process_group(backend, store=dist.PrefixStore("cb/set/", store), rank=rank, world_size=world,
                            timeout=timedelta(seconds=JOIN_TIMEOUT))
    return store


def publish(store: dist.Store, rank: int, address: str) -> None:
    """Tells node 0's launcher where this rank serves."""
    store.set(address_key(rank), address)


def watch(store: dist.Store, rendezvous: str) -> None:
    """Exits the process (code 1) once node 0's store stops answering: its launcher stopped, or the network did."""
    def look() -> None:
        while True:
            time.sleep(WATCH_EVERY)
            try:
                store.check([address_key(0)])
            except Exception as error:  # any failure to reach it: there is nothing left to serve
                log.error("node 0's store at %s stopped answering (%s): its launcher has stopped or the network "
                          "failed; exiting", rendezvous, str(error).splitlines()[0] if str(error) else error)
                logging.shutdown()
                os._exit(1)
    threading.Thread(target=look, name="watch node 0", daemon=True).start()


def tcp_address(rendezvous: str) -> str:
    """Where a rank on another node serves gRPC: this machine's address on the route to the store, any port."""
    host = route_address(*split(rendezvous))
    return f"[{host}]:0" if ":" in host else f"{host}:0"
