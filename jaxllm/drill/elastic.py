"""Elastic recovery: the drill's supervisor as the job's elastic agent.

A `host_down` fault kills one process of the job and keeps its host down for `down_s` seconds; the others stop
on their own (the peer watch). Then, as an operator's agent would:
- `elastic.wait_s` = 0 (stop-and-wait): wait for the host, restart on every process;
- `elastic.wait_s` > 0: wait at most that long for the host; if it is still down, restart on the survivors (one
  process less, each with its host's devices), where the config's mesh shrinks on `data`/`fsdp` and gradient
  accumulation grows so that the global batch and the data order stay the job's
  (`jaxllm.config.schema.elastic_shape`) and the checkpoint reshards on load. Once the host is back, at the
  next checkpoint step after that the job saves and stops (asked through its control file, so that it stops on
  that step exactly) and the agent restarts it on every process: the job grows back.

JAX's distributed runtime has no way to change the set of processes of a running job, so the agent restarts
the job (as torchelastic restarts its workers); what survives is the checkpoint.
"""

from __future__ import annotations

import json
import os
import time

from jaxllm.drill.job import DEVICE_COUNT
from jaxllm.drill.supervisor import PREEMPTED, Outcome, Supervisor


class ElasticSupervisor(Supervisor):
    """`Supervisor` with hosts that go down (`host_down` faults) and an elastic restart policy (`wait_s`)."""

    def __init__(self, *args, wait_s: float, down_s: float, every: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.wait_s, self.down_s, self.every = wait_s, down_s, every
        found = DEVICE_COUNT.search((self.env or os.environ).get("XLA_FLAGS", ""))
        # Each process is a host with its own devices: fewer hosts, fewer devices.
        self.devices_per_process = int(found.group(1)) // self.processes if found else None
        self.down_until: float | None = None  # when the lost host comes back (time.monotonic())
        self.grow_at: int | None = None  # the checkpoint step the shrunk job was asked to stop at
        self.shrunk_outcome: Outcome | None = None  # the fault whose host the job runs without

    def _processes_now(self) -> int:
        return self.processes - (1 if self._host_down() else 0)

    def _host_down(self) -> bool:
        return self.down_until is not None and time.monotonic() < self.down_until

    def _while_down(self, outcome: Outcome) -> None:
        if outcome.fault.kind != "host_down":
            return super()._while_down(outcome)
        self.down_until = time.monotonic() + self.down_s
        waited = min(self.down_s, self.wait_s) if self.wait_s > 0 else self.down_s
        time.sleep(waited)
        if self._host_down():
            outcome.detail += f"; the host stayed down: restarted on {self._processes_now()} of {self.processes} " \
                              f"processes after {waited:.1f}s"
            self.shrunk_outcome = outcome
        else:
            outcome.detail += f"; waited {waited:.1f}s for the host, restarted on all {self.processes} processes"

    def _drain(self) -> None:
        super()._drain()
        if self.shrunk_outcome is None or self.grow_at is not None or self._host_down():
            return
        if self.process.poll() is not None:
            return
        # The host is back: ask the job to save and stop at its next checkpoint (a control-file change,
        # jaxllm/train/control.py, so that it lands on that step exactly), then restart it on every process.
        from jaxllm.train.control import CONTROL_FILE, write_control  # imports JAX: only once it is needed

        at = self.last_step if self.last_step is not None else self._newest_committed()
        self.grow_at = (at // self.every + 1) * self.every
        path = self.checkpoints.parent / CONTROL_FILE
        changes = json.loads(path.read_text()) if path.exists() else []
        changes = changes if isinstance(changes, list) else [changes]
        write_control(self.checkpoints.parent, [*changes, {"id": f"elastic-grow-{self.starts}", "stop": True,
                                                          "at_step": self.grow_at}])

    def _restarted_after_planned_stop(self) -> bool:
        if self.grow_at is None:
            return False
        saved = PREEMPTED.search(self.process.log())
        if not saved:  # it had finished before the stop came due
            return False
        outcome, self.shrunk_outcome, self.grow_at = self.shrunk_outcome, None, None
        step = int(saved.group(1))
        outcome.detail += f"; the host came back: grew back to {self.processes} processes at step {step}"
        self._start(step)
        return True
