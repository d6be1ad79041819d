"""Multi-process start-up: who the processes are, a rendezvous that names latecomers, then JAX's distributed init.

Where the process layout comes from, first match wins:
  1. flags `--coordinator_address --num_processes --process_id`,
  2. the environment `JAX_COORDINATOR_ADDRESS JAX_NUM_PROCESSES JAX_PROCESS_ID` (the Kubernetes JobSet template),
  3. a cluster JAX detects (SLURM, Open MPI, ...; the SLURM template relies on this),
  4. none of these: a single process, nothing to initialise.

Why a rendezvous of our own before `jax.distributed.initialize`: when a process never arrives, JAX's coordination
service aborts every process with `DEADLINE_EXCEEDED` and no word of which one is missing. Process 0 listens one
port above the coordinator's; every other process checks in there with its id, so on a timeout process 0 can name
the processes that did not arrive (and tells those that did), and a process that cannot reach process 0 says so.
Once everyone is in, JAX's own initialisation follows immediately. The rendezvous links stay open: when a process
dies, every survivor names it and exits 1 at once (jaxllm/runtime/peer_watch.py); a host that vanishes without closing
them is caught by the coordination service's heartbeats within `heartbeat_timeout` seconds.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Mapping

from jaxllm.runtime.peer_watch import watch
from jaxllm.runtime.wire import recv_line, send_line

ENV_KEYS = {"coordinator_address": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
            "process_id": "JAX_PROCESS_ID"}


class DistributedError(RuntimeError):
    """The processes of a run could not be brought together (or the layout given for them is inconsistent)."""


@dataclasses.dataclass(frozen=True)
class ProcessLayout:
    """This process's place in the job. `source` says where the values came from (flags, env, slurm, ...)."""

    coordinator_address: str
    num_processes: int
    process_id: int
    source: str
    local_device_ids: tuple[int, ...] | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.coordinator_address.rpartition(":")
        return host.strip("[]"), int(port)


def _parse_int(value, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedError(f"{key}: expected an integer, got {value!r}") from None


def _check(coordinator_address, num_processes, process_id, source: str, keys: Mapping[str, str],
           local_device_ids=None) -> ProcessLayout:
    missing = [keys[k] for k, v in (("coordinator_address", coordinator_address), ("num_processes", num_processes),
                                    ("process_id", process_id)) if v in (None, "")]
    if missing:
        given = [keys[k] for k in keys if keys[k] not in missing]
        raise DistributedError(f"{', '.join(missing)}: missing; {', '.join(given)} given, a multi-process run "
                               f"needs all three")
    num_processes = _parse_int(num_processes, keys["num_processes"])
    process_id = _parse_int(process_id, keys["process_id"])
    if num_processes < 1:
        raise DistributedError(f"{keys['num_processes']}: must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise DistributedError(f"{keys['process_id']}: {process_id} is outside [0, {num_processes})")
    host, sep, port = str(coordinator_address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise DistributedError(f"{keys['coordinator_address']}: expected host:port, got {coordinator_address!r}")
    return ProcessLayout(str(coordinator_address), num_processes, process_id, source, local_device_ids)


def _detected_cluster(environ: Mapping[str, str]) -> ProcessLayout | None:
    """The layout from a cluster environment JAX knows (SLURM, Open MPI, ...), or None outside one.

    JAX would pin each process to the one device numbered by its local rank; that is right for one process per
    GPU but with one process per node (our SLURM template) it would hide all GPUs but the first, so devices are
    pinned only when a node runs several processes.
    """
    from jax._src import clusters  # private, but it is JAX's own cluster detection, kept in sync with JAX

    env = next((c for c in clusters.ClusterEnv._cluster_types
                if not c.opt_in_only_method and c.is_env_present()), None)
    if env is None:
        return None
    port = environ.get("JAX_COORDINATOR_PORT")
    address = env.get_coordinator_address(timeout_secs=None, override_coordinator_port=port)
    count, pid = env.get_process_count(), env.get_process_id()
    per_node = None
    if "SLURM_NTASKS" in environ and "SLURM_STEP_NUM_NODES" in environ:
        per_node = int(environ["SLURM_NTASKS"]) // max(int(environ["SLURM_STEP_NUM_NODES"]), 1)
    elif "OMPI_COMM_WORLD_LOCAL_SIZE" in environ:
        per_node = int(environ["OMPI_COMM_WORLD_LOCAL_SIZE"])
    local = env.get_local_process_id()
    local_ids = (local,) if per_node and per_node > 1 and local is not None else None
    name = getattr(env, "name", env.__name__)
    return _check(address, count, pid, name, {k: f"{name} {k}" for k in ENV_KEYS}, local_ids)


def resolve_layout(coordinator_address: str | None = None, num_processes: int | None = None,
                   process_id: int | None = None, environ: Mapping[str, str] | None = None) -> ProcessLayout | None:
    """This process's layout from flags, else `JAX_*` environment variables, else a detected cluster.

    Returns None for a single-process run. Raises `DistributedError` (naming the flag or variable) when the
    values are incomplete or inconsistent.
    """
    environ = os.environ if environ is None else environ
    flags = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in flags.values()):
        layout = _check(**flags, source="flags", keys={k: f"--{k}" for k in flags})
    elif any(environ.get(v) for v in ENV_KEYS.values()):
        layout = _check(*(environ.get(ENV_KEYS[k]) for k in flags), source="env", keys=ENV_KEYS)
    else:
        layout = _detected_cluster(environ)
    return layout if layout is not None and layout.num_processes > 1 else None


def _host_rendezvous(layout: ProcessLayout, port: int, deadline: float, timeout: float) -> dict[int, socket.socket]:
    """Process 0: wait for every other process to check in; name the missing ones on timeout. Returns the open
    link to each of them (jaxllm/runtime/peer_watch.py)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", port))
    except OSError as exc:
        raise DistributedError(f"process 0 cannot listen on rendezvous port {port} (coordinator port + 1): {exc}")
    server.listen(layout.num_processes)
    arrived: dict[int, socket.socket] = {}
    try:
        while len(arrived) < layout.num_processes - 1:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, layout.num_processes)) - set(arrived))
                message = (f"process{'es' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of "
                           f"{layout.num_processes} did not arrive within {timeout:g}s (--init_timeout) at "
                           f"{layout.coordinator_address}")
                for conn in arrived.values():
                    send_line(conn, "abort " + message)
                raise DistributedError(message)
            server.settimeout(remaining)
            try:
                conn, _ = server.accept()
            except socket.timeout:
                continue
            line = recv_line(conn, min(deadline, time.monotonic() + 10))
            if not line or not line.startswith("hello "):
                conn.close()
                continue
            pid = _parse_int(line.split()[1], "rendezvous process id")
            if pid in arrived or not 0 < pid < layout.num_processes:
                send_line(conn, f"abort process id {pid} is duplicated or outside [1, {layout.num_processes})")
                conn.close()
                continue
            arrived[pid] = conn
        for conn in arrived.values():
            send_line(conn, "go")
        links, arrived = arrived, {}
        return links
    finally:
        for conn in arrived.values():
            conn.close()
        server.close()


def _join_rendezvous(layout: ProcessLayout, port: int, deadline: float, timeout: float) -> dict[int, socket.socket]:
    """Process k > 0: check in with process 0 and wait for everyone else. Returns the open link to process 0."""
    host = layout.host_port[0]
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=max(min(5.0, deadline - time.monotonic()), 0.1))
            if conn.getsockname() == conn.getpeername():
                # Linux TCP "simultaneous open": retrying a connect to a local port nobody listens on can pick that
                # very port as its source and connect to itself, so our own hello would come back as the answer.
                conn.close()
                raise ConnectionRefusedError
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(f"process 0 (the coordinator, rendezvous at {host}:{port}) did not arrive "
                                       f"within {timeout:g}s (--init_timeout); this is process "
                                       f"{layout.process_id} of {layout.num_processes}") from None
            time.sleep(0.25)
    try:
        send_line(conn, f"hello {layout.process_id}")
        reply = recv_line(conn, deadline + 5)  # process 0 answers at its own deadline at the latest
    except BaseException:
        conn.close()
        raise
    if reply == "go":
        return {0: conn}
    conn.close()
    if reply and reply.startswith("abort "):
        raise DistributedError(reply[len("abort "):])
    raise DistributedError(f"process 0 at {host}:{port} stopped answering during the rendezvous "
                           f"(this is process {layout.process_id} of {layout.num_processes})")


def rendezvous(layout: ProcessLayout, timeout: float) -> dict[int, socket.socket]:
    """Block until all `layout.num_processes` processes have checked in, or raise naming the ones missing.

    Returns this process's links, left open for jaxllm/runtime/peer_watch.py: process 0's to every other process, the
    others' to process 0."""
    port = layout.host_port[1] + 1
    deadline = time.monotonic() + timeout
    if layout.process_id == 0:
        return _host_rendezvous(layout, port, deadline, timeout)
    return _join_rendezvous(layout, port, deadline, timeout)


def initialize(layout: ProcessLayout, *, init_timeout: float = 300, heartbeat_timeout: int = 100) -> None:
    """Bring up JAX across the processes of `layout` (call before anything touches a device).

    CPU collectives go through gloo (the default CPU client cannot talk across processes); the setting only
    affects the CPU backend, so it is harmless on GPU hosts.
    """
    import jax  # start-up speed: the process layout is resolved (and bad flags refused) before JAX loads

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    start = time.monotonic()
    watch(layout.process_id, layout.num_processes, rendezvous(layout, init_timeout))  # names a peer that dies
    remaining = max(int(init_timeout - (time.monotonic() - start)), 10)
    jax.distributed.initialize(
        layout.coordinator_address, num_processes=layout.num_processes, process_id=layout.process_id,
        local_device_ids=list(layout.local_device_ids) if layout.local_device_ids else None,
        initialization_timeout=remaining, heartbeat_timeout_seconds=int(heartbeat_timeout),
    )


def free_port_pair() -> int:
    """A port p of this host with p and p + 1 both free: a coordinator address for a job started here (the
    coordinator listens on p, the start-up rendezvous on p + 1)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65534:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free pair of ports")
