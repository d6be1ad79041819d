"""The hang watchdog: a run whose steps stop completing dumps its stacks and exits with HANG_EXIT_CODE."""

import subprocess
import time

from train_runs import losses, train_command, train_env

from jaxllm.runtime.watchdog import HANG_EXIT_CODE, HangWatchdog


def _watch(tmp_path, timeout_s: float, beats: int, every_s: float):
    """Run a watchdog for `beats` heartbeats `every_s` apart, then wait for it; (exit codes, stream text)."""
    exits = []
    with open(tmp_path / "stream.txt", "w") as stream:
        dog = HangWatchdog(timeout_s, stream=stream, exit=exits.append, poll_s=0.01).start()
        for step in range(1, beats + 1):
            time.sleep(every_s)
            dog.beat(step, every_s)
        deadline = time.monotonic() + 3 * timeout_s + 2.0
        while not exits and time.monotonic() < deadline and timeout_s > 0:
            time.sleep(0.01)
        dog.stop()
    return exits, (tmp_path / "stream.txt").read_text()


def test_heartbeats_keep_the_watchdog_quiet_and_silence_fires_it(tmp_path):
    # Beats 0.05 s apart for 1.5 s against a 1 s timeout (longer than the timeout, so a clock that is not
    # restarted by each beat fires; margin for a loaded CI machine): no alarm; then silence: one alarm naming step 30.
    exits, text = _watch(tmp_path, 1.0, beats=30, every_s=0.05)
    assert exits == [HANG_EXIT_CODE]
    assert "last completed step 30" in text and "_watch" in text  # the message, then every thread's stack


def test_zero_timeout_is_off(tmp_path):
    exits, text = _watch(tmp_path, 0.0, beats=2, every_s=0.3)
    assert exits == [] and text == ""


def test_stalled_run_dumps_stacks_and_exits_for_requeue(shakespeare_store, tmp_path):
    """A real run whose step 3 never completes (debug.stall_at_step) is ended by the watchdog."""
    proc = subprocess.run(train_command(shakespeare_store, tmp_path, "--config.train.steps=6",
                                        "--config.train.eval_every=1000", "--config.checkpoint.every=1000",
                                        "--config.train.hang_timeout_s=15", "--config.debug.stall_at_step=3"),
                          capture_output=True, text=True, env=train_env(), timeout=600)
    assert proc.returncode == HANG_EXIT_CODE, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("hang watchdog:")]
    assert len(message) == 1 and "last completed step 2 " in message[0], proc.stderr[-3000:]
    # faulthandler's dump: the main thread is where the loop waits for step 3's metrics.
    assert "most recent call first" in proc.stderr and "in report" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "hang-stacks-0.txt").read_text().startswith(message[0])
    assert sorted(losses(tmp_path)) == [1, 2]
