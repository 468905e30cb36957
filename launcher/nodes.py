"""A tensor-parallel set across machines (`--nnodes` > 1), as the launchers see it.

Every node's launcher starts its own ranks (--num-shard / --nnodes of them, node by node). Node 0's launcher also
hosts the store they meet at (shard/rendezvous.py) and, once the other nodes' ranks have published where they
serve, starts the router with every rank's address. A set across machines is never replaced: when any rank
exits, or a rank on another node stops answering, node 0's launcher stops everything and exits 1; the other
nodes' ranks then find the store gone and exit 1, and so do their launchers. Restart every node's launcher.
"""
import time
from dataclasses import dataclass, field
from datetime import timedelta

from launcher.readiness import shard_healthy
from router.settings import Settings
from shard.rendezvous import address_key

NOT_REPLACED = "a set across nodes is not replaced (restart every node's launcher)"
PROBE_EVERY = 2.0  # s between node 0's Health probes of the other nodes' ranks
STRIKES = 2        # probes missed in a row that end the set (one may be a loaded network's hiccup)


def ranks(settings: Settings) -> range:
    """The ranks this node runs."""
    per_node = settings.num_shard // settings.nnodes
    return range(settings.node_rank * per_node, (settings.node_rank + 1) * per_node)


def store_url(settings: Settings) -> str:
    host = settings.master_addr
    return f"tcp://[{host}]:{settings.master_port}" if ":" in host else f"tcp://{host}:{settings.master_port}"


class RemoteLost(Exception):
    """A rank on another node stopped answering."""


@dataclass
class Remote:
    """Node 0's view of the ranks on the other nodes, through the store it hosts."""
    settings: Settings
    store: object = None
    addresses: dict[int, str] = field(default_factory=dict)
    strikes: dict[int, int] = field(default_factory=dict)
    next_probe: float = 0.0

    def host(self) -> None:
        """Opens the store (torch is imported only here: a one-machine launcher starts without it)."""
        import torch.distributed as dist

        self.store = dist.TCPStore(self.settings.master_addr, self.settings.master_port, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=30))

    @property
    def ranks(self) -> list[int]:
        return [r for r in range(self.settings.num_shard) if r not in ranks(self.settings)]

    def published(self) -> bool:
        """Whether every remote rank has said where it serves (it does once loaded); reads those that have."""
        for rank in self.ranks:
            if rank not in self.addresses and self.store.check([address_key(rank)]):
                self.addresses[rank] = self.store.get(address_key(rank)).decode()
        return len(self.addresses) == len(self.ranks)

    def pending(self) -> str:
        return ", ".join(f"rank {r}" for r in self.ranks if r not in self.addresses) + " on the other nodes to load"

    def silent(self) -> list[str]:
        """The remote ranks that do not answer Health now, named."""
        return [f"rank {rank} at {address}" for rank, address in self.addresses.items() if not shard_healthy(address)]

    def check(self) -> bool:
        """Probes every remote rank's Health every PROBE_EVERY s; raises RemoteLost when one missed STRIKES in a
        row. Never ready (the supervisor's wait goes on)."""
        if time.monotonic() >= self.next_probe:
            self.next_probe = time.monotonic() + PROBE_EVERY
            for rank, address in self.addresses.items():
                self.strikes[rank] = 0 if shard_healthy(address) else self.strikes.get(rank, 0) + 1
                if self.strikes[rank] >= STRIKES:
                    raise RemoteLost(f"rank {rank} at {address} stopped answering Health ({STRIKES} probes "
                                     f"{PROBE_EVERY:g} s apart)")
        return False
