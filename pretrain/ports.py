"""Local TCP ports (no heavy imports: the driver asks for one before it imports torch)."""

from __future__ import annotations

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
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return False
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
