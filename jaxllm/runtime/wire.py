"""The rendezvous wire: newline-terminated text lines over the TCP links between process 0 and the others, used
by the start-up rendezvous (jaxllm/runtime/distributed.py) and the peer watch that keeps the links open
(jaxllm/runtime/peer_watch.py)."""

from __future__ import annotations

import socket
import time


def send_line(sock: socket.socket, message: str) -> None:
    """`message` and a newline to `sock`; a peer already gone is not an error (its watcher reports it)."""
    try:
        sock.sendall(message.encode() + b"\n")
    except OSError:
        pass


def recv_line(sock: socket.socket, deadline: float) -> str | None:
    """One line from `sock` (without its newline), or None when `deadline` (time.monotonic) passes first or the
    peer closes the link."""
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(256)
        except (socket.timeout, OSError):
            return None
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")
