"""Local TCP ports (no heavy imports: the driver asks for one before it imports torch)."""

from __future__ import annotations

import errno
import socket


def free_port(avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A free TCP port on 127.0.0.1 that is not in ``avoid``."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError("could not find a free local port")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``host:port`` now (as servers do, with SO_REUSEADDR: TIME_WAIT is not "in
    use")."""
    return port_problem(port, host) is None


def port_problem(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a server could not bind ``host:port`` now, as a phrase after ``host:port``; None when it could. A host
    that does not resolve, or is no address of this machine, is said as such, not as a busy port."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        return f"does not resolve ({e.strerror or e})"
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "is in use"
            if e.errno == errno.EADDRNOTAVAIL:
                return f"cannot be bound: {host} is not an address of this machine"
            return f"cannot be bound ({e.strerror or e})"
    return None
