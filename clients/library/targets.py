"""Triton gRPC targets that name one or several replicas, and the channel arguments that spread
generations over them with gRPC's own `round_robin` load balancing.

Accepted forms (gRPC's own target syntax, plus a plain list for convenience):
  host:port                    one name; gRPC resolves it (every address it resolves to is used)
  dns:///name:port             the same, explicitly: e.g. a Kubernetes headless Service
  ipv4:a:port,b:port           a fixed list of IPv4 replicas (ipv6:[a]:port,... likewise)
  a:port,b:port                a plain list of IP literals: becomes the ipv4:/ipv6: form

Each generation is its own gRPC stream (one RPC), and `round_robin` sends each new RPC to the
next ready connection, so generations spread over replicas while one channel holds one HTTP/2
connection per replica. gRPC re-resolves a name only when a connection closes, so servers should
close connections after a maximum age (tritonserver --grpc-max-connection-age) for clients to
find replicas added later.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Sequence
from dataclasses import dataclass

DNS_SCHEME = "dns:"
LIST_SCHEMES = ("ipv4:", "ipv6:")

# One policy for every channel: with one address it behaves like the default pick_first.
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
# gRPC's default is 30 s between DNS resolutions; a closed connection then waits that long
# before a new replica is seen. One second keeps the pickup close to the connection age.
DNS_MIN_RESOLUTION_INTERVAL_MS = 1000
BALANCING_ARGS = (
    ("grpc.service_config", SERVICE_CONFIG),
    ("grpc.dns_min_time_between_resolutions_ms", DNS_MIN_RESOLUTION_INTERVAL_MS),
)


@dataclass(frozen=True)
class Target:
    """A gRPC target naming one or several Triton replicas."""

    uri: str  # what the gRPC channel is given
    host: str | None = None  # the name to resolve (dns form), None for a fixed list
    port: int | None = None
    addresses: tuple[str, ...] = ()  # host:port of each replica of a fixed list

    @property
    def is_list(self) -> bool:
        """True for a fixed list of addresses (no name to resolve)."""
        return self.host is None

    def replicas(self) -> list[str]:
        """host:port of each replica right now (a name is resolved anew on each call)."""
        if self.is_list:
            return list(self.addresses)
        return resolve(self.host, self.port)

    def hosts(self) -> list[str]:
        """The host names or addresses the target mentions (not resolved)."""
        if self.is_list:
            return [_split_host_port(a)[0].strip("[]") for a in self.addresses]
        return [self.host]


def parse_target(text: str) -> Target:
    """A Target from `host:port`, `dns:///name:port`, `ipv4:a:p,b:p` or `a:p,b:p`; ValueError."""
    text = text.strip()
    if not text:
        raise ValueError("empty Triton target")
    if text.startswith(LIST_SCHEMES):
        scheme, rest = text[:5], text[5:]
        return _list_target(rest.split(","), scheme[:-1])
    if text.startswith(DNS_SCHEME):
        return _dns_target(text)
    if "," in text:
        return _list_target(text.split(","), None)
    host, port = _split_host_port(text)
    return Target(uri=text, host=host.strip("[]"), port=port)


def channel_args(base: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    """`base` (message limits, backoff) plus round_robin balancing; tritonclient uses only these."""
    return [*base, *BALANCING_ARGS]


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as sorted host:port strings ([v6]:port for IPv6)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return sorted({_join(info[4][0], port) for info in infos})


def _dns_target(text: str) -> Target:
    # dns:[//authority/]host:port; the authority (a DNS server) is for gRPC only
    rest = text[len(DNS_SCHEME) :]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[-1] if "/" in rest[2:] else ""
    host, port = _split_host_port(rest)
    return Target(uri=text, host=host.strip("[]"), port=port)


def _list_target(items: list[str], scheme: str | None) -> Target:
    addresses = []
    for item in items:
        host, port = _split_host_port(item.strip())
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(
                f"a list of replicas needs IP addresses, got {host!r}; "
                "for a name use dns:///name:port"
            ) from None
        addresses.append((ip, port))
    versions = {ip.version for ip, _ in addresses}
    if len(versions) != 1 or (scheme and scheme != f"ipv{versions.pop()}"):
        raise ValueError("a list of replicas takes addresses of one family (ipv4: or ipv6:)")
    family = f"ipv{addresses[0][0].version}"
    joined = [_join(str(ip), port) for ip, port in addresses]
    return Target(uri=f"{family}:{','.join(joined)}", addresses=tuple(joined))


def _split_host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if ":" in host and not host.startswith("["):
        raise ValueError(f"write an IPv6 address in brackets: [{host}]:{port}")
    return host, int(port)


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def target_option(text: str) -> str:
    """argparse type of a --triton / --url option: the target's gRPC form, or a clear error."""
    import argparse

    try:
        return parse_target(text).uri
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


TARGET_HELP = (
    "Triton gRPC target: HOST:PORT, dns:///NAME:PORT (every address of the name) or a list "
    "ipv4:A:PORT,B:PORT; generations spread over the replicas (round_robin)"
)
