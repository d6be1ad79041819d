"""Naming the process that died: a survivor of a multi-process job says which process is gone, then exits.

The start-up rendezvous (jaxllm/runtime/distributed.py) leaves one TCP link open between process 0 and every other process
for the life of the job. However a process dies (SIGKILL, the OOM killer, a crash), its kernel closes its links at
once (they are not inherited by child processes: PEP 446, and grain's workers are spawned), so the process at the
other end learns which one went: process 0 learns of process k directly and tells the others ("gone k") before it
exits itself; a process k > 0 whose link to process 0 closes with no such word names process 0, the coordinator. A
process that exits through Python's normal shutdown says "bye" first (atexit), so a clean exit is never taken for a
death. The survivor prints one line naming the dead process(es) and exits 1 at once: the job cannot go on without
them (a collective would fail, or on GPUs hang), and a scheduler's requeue restarts it from its last checkpoint.

Why not JAX's own liveness (measured with jaxlib 0.10.2 on 2 CPU processes): `client.get_live_nodes` answers only
once the coordination service has declared the process dead, `heartbeat_timeout` seconds after it died (19.8 s
with 20 s), and at that same moment the service's error polling terminates every process from C++ ("Terminating
process because the JAX distributed service detected fatal errors"), before Python prints anything; when the
coordinator itself dies, that termination comes within milliseconds. A `missed_heartbeat_callback` given to the
client from Python, which would replace the termination, aborts the process with std::bad_cast when it fires. A
host that vanishes without closing its connections (power loss) is still left to that heartbeat, whose own
message names the task ("The following tasks are unhealthy (stopped sending heartbeats): 1"). When process 0
dies, that C++ termination of the others races this watch's line; the line has come out first in every run
measured here (12 of 12: JAX logs a stack trace before it aborts; the line followed its first log line by ~1-3 ms).
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
import time

from jaxllm.runtime.wire import send_line

BYE = "bye"  # this process exits cleanly
GONE = "gone"  # process 0 to the others: "gone k", process k died
# Process 0: after a first link closed, how long others closing too (one host's processes) are collected. Not the
# others: their one link is to process 0, whose death JAX's error polling answers within milliseconds.
GRACE_S = 0.2
VERDICT_WAIT_S = 5.0  # how long a process whose collective failed waits for the watch to name a dead peer

_active: PeerWatch | None = None


def loss_message(dead: list[int], process_id: int, num_processes: int) -> str:
    """The line a survivor prints: the dead processes named, or process 0 as the coordinator."""
    if dead == [0]:
        return (f"jaxllm: process 0 (the coordinator) is unreachable: its link to process {process_id} of "
                f"{num_processes} closed; exiting so the job can be requeued")
    plural = "es" if len(dead) > 1 else ""
    return (f"jaxllm: process{plural} {', '.join(map(str, dead))} of {num_processes} stopped responding (link to "
            f"process {process_id} closed); exiting so the job can be requeued")


class PeerWatch:
    """Watches this process's links (peer id -> connected socket) from a daemon thread; when one closes without a
    "bye", `report`s `loss_message` once and calls `exit(1)` (os._exit: the main thread may be stuck in a
    collective, and JAX's own C++ termination may be on its way)."""

    def __init__(self, process_id: int, num_processes: int, links: dict[int, socket.socket], report=None,
                 exit=os._exit):
        self.process_id, self.num_processes = process_id, num_processes
        self.links = dict(links)
        self.report = report or (lambda line: print(line, file=sys.stderr, flush=True))
        self.exit = exit
        self.left: set[int] = set()  # peers that said bye
        self.gone: list[int] = []  # deaths process 0 told us of
        self.leaving = False
        self.verdict = threading.Event()  # set once the dead are named
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="jaxllm-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        for sock in self.links.values():
            sock.settimeout(None)
        self._thread.start()
        return self

    def _watch(self) -> None:
        selector = selectors.DefaultSelector()
        buffers = {peer: b"" for peer in self.links}
        for peer, sock in self.links.items():
            selector.register(sock, selectors.EVENT_READ, peer)
        closed: list[int] = []
        deadline = None  # GRACE_S after the first link closed without a bye
        while deadline is None or time.monotonic() < deadline:
            if not selector.get_map():
                if deadline is None:  # every peer said bye
                    return
                time.sleep(max(deadline - time.monotonic(), 0))
                break
            for key, _ in selector.select(None if deadline is None else max(deadline - time.monotonic(), 0)):
                peer = key.data
                try:
                    data = key.fileobj.recv(4096)
                except OSError:
                    data = b""
                if data:
                    *lines, buffers[peer] = (buffers[peer] + data).split(b"\n")
                    self._heard(peer, [line.decode(errors="replace") for line in lines])
                    continue
                selector.unregister(key.fileobj)
                if peer not in self.left:
                    closed.append(peer)
                    deadline = deadline or time.monotonic() + (GRACE_S if self.process_id == 0 else 0.0)
        selector.close()
        self._lost(closed)

    def _heard(self, peer: int, lines: list[str]) -> None:
        for line in lines:
            if line == BYE:
                self.left.add(peer)
            elif line.startswith(GONE + " ") and peer == 0:
                self.gone.append(int(line.split()[1]))

    def _lost(self, closed: list[int]) -> None:
        """`closed`: the peers whose link closed without a bye (for a process k > 0: process 0)."""
        with self._lock:
            if self.leaving or self.verdict.is_set():
                return
            self.verdict.set()
        if self.process_id == 0:
            dead = sorted(closed)
            for peer, sock in self.links.items():  # so that the others name them, not us, when we exit
                if peer not in dead:
                    send_line(sock, "\n".join(f"{GONE} {d}" for d in dead))
        else:
            dead = sorted(set(self.gone)) or [0]
        self.report(loss_message(dead, self.process_id, self.num_processes))
        self.exit(1)

    def leave(self) -> None:
        """Tell the peers this process exits cleanly (atexit), and stop watching them."""
        with self._lock:
            if self.verdict.is_set():
                return
            self.leaving = True
        for sock in self.links.values():
            send_line(sock, BYE)


def watch(process_id: int, num_processes: int, links: dict[int, socket.socket]) -> PeerWatch:
    """Start watching `links` for this process (the one watch `await_verdict` waits on)."""
    import atexit

    global _active
    _active = PeerWatch(process_id, num_processes, links).start()
    atexit.register(_active.leave)
    return _active


def await_verdict(timeout: float = VERDICT_WAIT_S) -> bool:
    """After a failed collective: wait up to `timeout` seconds for the watch to name a dead peer (it then exits
    this process itself, so this returns only when no death is known: False)."""
    if _active is None:
        return False
    named = _active.verdict.wait(timeout)
    if named:  # the watch is printing and exiting; do not race it with another message
        time.sleep(timeout)
    return named
