"""The fault drill's short CI run (scripts/drill.py): kill -9 at random moments (inside async saves too) and
corrupt checkpoints on the tiny job, recovered every time, resumed from the newest committed checkpoint, never
from a corrupt one, and ending bitwise on the shared uninterrupted reference run's parameters and losses."""

import re

import pytest

from train_runs import RESUME, run_drill

from jaxllm.drill.disk import SLACK, SmallDisk, mount_problem
from jaxllm.drill.plan import FaultSpecError, anomaly_flags, hot_changes, parse_faults, schedule

JOB = (*RESUME, "--config.train.steps=8")  # the job of the shared `uninterrupted` run (tests/conftest.py)


def test_short_drill_recovers_bitwise(shakespeare_store, uninterrupted, tmp_path):
    result = run_drill(shakespeare_store, uninterrupted, tmp_path / "drill", "kill9:5,corrupt:2", *JOB)
    assert result["faults"] == {"kill9": 5, "corrupt": 2}
    assert result["recoveries"] == result["injected"] == 7 and result["unplanned_exits"] == []
    assert result["corrupt_loads"] == 0 and result["wrong_resumes"] == []  # each restart: the newest committed
    assert result["bitwise_equal"] is True and result["losses_equal"] is True and result["finished"]
    assert len(result["steps_lost"]) == len(result["recover_s"]) == 7 and 0 < result["goodput"] < 1
    checkpoints = tmp_path / "drill" / "run" / "checkpoints"
    # An unreadable checkpoint is moved aside whole (the damaged file with it), never loaded or overwritten; the
    # uncommitted directories of killed saves are cleaned up.
    for event in (e for e in result["events"] if e["kind"] == "corrupt"):
        step, what, name, size = re.fullmatch(r"checkpoint (\d+): (truncated|deleted) (\S+) (?:to )?\(?(\d+).*",
                                              event["detail"]).groups()
        assert event["quarantined"] and event["resumed"] < int(step)
        (moved,) = [p for p in checkpoints.iterdir() if re.fullmatch(rf"corrupt-{step}-\d+", p.name)]
        if what == "truncated":
            assert (moved / name).stat().st_size == int(size)
        else:
            assert not (moved / name).exists()
    assert not [p.name for p in checkpoints.iterdir() if "tmp" in p.name]


def test_drill_on_two_checkpoint_tiers_recovers_bitwise(shakespeare_store, uninterrupted, tmp_path):
    """A job with a local checkpoint tier: its local tier deleted while it is down (a replaced node), its
    persistent tier throttled so that copies fall behind, and a corrupt local copy; each restart resumes the
    newest step that verifies on either tier and the job ends bitwise on the one-tier reference."""
    local = tmp_path / "local"
    result = run_drill(shakespeare_store, uninterrupted, tmp_path / "drill", "local_wipe:1,slow_persistent:1,corrupt:1",
                       *JOB, f"--config.checkpoint.local_dir={local}", seed=3)
    assert result["recoveries"] == result["injected"] == 3 and result["unplanned_exits"] == []
    assert result["wrong_resumes"] == [] and result["corrupt_loads"] == 0
    assert result["bitwise_equal"] is True and result["losses_equal"] is True and result["finished"]
    events = {e["kind"]: e for e in result["events"]}
    wipe = events["local_wipe"]
    persistent_step = int(re.search(r"persistent tier at step (\d+)", wipe["detail"]).group(1))
    assert "local tier deleted" in wipe["detail"] and wipe["resumed"] == persistent_step, wipe
    assert "throttled" in events["slow_persistent"]["detail"]
    corrupt = events["corrupt"]  # the damaged local copy is moved aside; its persistent copy resumes
    assert corrupt["quarantined"] and corrupt["resumed"] == int(corrupt["detail"].split()[1].rstrip(":")), corrupt


def test_full_disk_stops_the_job_loudly_and_it_resumes_bitwise(shakespeare_store, uninterrupted, tmp_path):
    problem = mount_problem(tmp_path / "probe")
    if problem is not None:
        pytest.skip(f"no small filesystem for a diskfull drill here: {problem}")
    result = run_drill(shakespeare_store, uninterrupted, tmp_path / "drill", "diskfull:1", *JOB)
    (event,) = result["events"]
    assert event["recovered"] and result["bitwise_equal"] and result["losses_equal"]
    # A failed background save stops training with exit 1 and an error naming it (never swallowed); the
    # checkpoints committed before it stay loadable: the restart resumes the newest.
    stopped = event["detail"].split("; the job stopped with ")[1]
    assert stopped.startswith("1: error:") and "save of step" in stopped and "failed" in stopped, event
    assert event["resumed"] == event["expected_resume"]



class RacingDisk(SmallDisk):
    """A save in flight: it writes more than SLACK right after the drill measures the filesystem, once."""

    def used(self) -> int:
        measured = super().used()
        if not (self.path / "late").exists():
            (self.path / "late").write_bytes(bytes(4 * SLACK))
        return measured


@pytest.mark.smoke
def test_filling_the_disk_outruns_a_save_in_flight(tmp_path):
    problem = mount_problem(tmp_path / "probe")
    if problem is not None:
        pytest.skip(f"no small filesystem here: {problem}")
    disk = RacingDisk(tmp_path / "checkpoints", size=1 << 20)
    try:
        # tmpfs refuses a limit below what it holds: the first remount fails and the fill measures again.
        limit = disk.fill()
        assert disk.used() <= limit <= disk.used() + SLACK
        with pytest.raises(OSError, match="No space left"):
            (disk.path / "next-save").write_bytes(bytes(2 * SLACK))
        disk.free()
    finally:
        disk.close()

@pytest.mark.smoke
def test_no_anomaly_rolls_back_where_a_stop_left_a_checkpoint_the_reference_lacks():
    """A rollback restores the newest checkpoint; a SIGTERM stop saves one the never-stopped reference does not
    have, so an anomaly after it in the same checkpoint interval rolled the drilled job back elsewhere than the
    reference (docs/training.md's drill, seed 0: sigterm at 121 saved 123, the nan at 163 went back to 123, the
    reference's to 100, and the final parameters differed). Anomalies are drawn outside those windows."""
    counts = parse_faults("kill9:20,sigterm:2,corrupt:2,nan:1,spike:1")
    for seed in range(40):
        plan = schedule(counts, seed, steps=300, every=100, min_history=20)
        stops = [f.step for f in plan if f.kind in ("sigterm", "corrupt")]
        for anomaly in (f for f in plan if f.kind in ("nan", "spike")):
            restored = 100 * ((anomaly.step - 1) // 100)  # the reference's rollback target
            assert not any(t < anomaly.step and restored <= t + 3 for t in stops), (seed, anomaly, stops)
    with pytest.raises(FaultSpecError, match="no step of 30 train.steps is left for nan"):  # stops everywhere
        schedule(parse_faults("sigterm:8,nan:1"), 0, steps=30, every=10, min_history=5)


@pytest.mark.smoke
def test_fault_plan_is_seeded_and_checked():
    counts = parse_faults("kill9:20,sigterm:2,corrupt:1,nan:1,spike:1")
    plan = schedule(counts, seed=3, steps=300, every=100, min_history=20)
    assert plan == schedule(counts, seed=3, steps=300, every=100, min_history=20) != schedule(
        counts, seed=4, steps=300, every=100, min_history=20)
    process = [f.step for f in plan if f.kind in ("kill9", "sigterm", "corrupt")]
    assert len(process) == 23 and process == sorted(process) and 1 <= min(process) and max(process) <= 298
    # A 2-process job stops on SIGTERM only at a multiple of 10 steps: those faults leave it steps to stop in.
    assert max(f.step for f in schedule({"sigterm": 50}, 1, 200, 5, 20, stop_every=10)) <= 179
    nan, spike = (next(f.step for f in plan if f.kind == k) for k in ("nan", "spike"))
    assert nan != spike and min(nan, spike) > 100  # after the first checkpoint: each one is a rollback
    # A start injects only the anomalies ahead of the checkpoint it resumes that the checkpoint has not rolled
    # back from yet (a restart after a rollback must not fire it twice, one before it must fire it again).
    first, second = sorted([(nan, "nan"), (spike, "spike")])
    assert anomaly_flags(plan, 0, 0) == [f"--config.debug.inject_{k}_at_step={s}" for s, k in (first, second)]
    assert anomaly_flags(plan, first[0] - 1, 1) == [f"--config.debug.inject_{second[1]}_at_step={second[0]}"]
    assert anomaly_flags(plan, first[0] - 1, 0)[0].endswith(f"={first[0]}")
    # Hot updates are drawn last: adding them leaves the other faults of a seed where they were; each is one
    # control.json change (halving the LR) that lands on its step exactly.
    hot = schedule({**counts, "hotlr": 3}, seed=3, steps=300, every=100, min_history=20)
    assert hot[:len(plan)] == plan and [f.kind for f in hot[len(plan):]] == ["hotlr"] * 3
    assert hot_changes(hot) == [{"id": f"drill-hotlr-{f.index}", "lr_scale": 0.5, "at_step": f.step}
                                for f in hot[len(plan):]]
    assert all(1 <= f.step <= 298 for f in hot[len(plan):]) and hot_changes(plan) == []
    for spec, message in [("kill9", "is not kind:count"), ("kill9:0", "positive"), ("nan:2", "at most 1"),
                          ("kill9:1,kill9:2", "given twice"), ("boom:1", "unknown kind")]:
        with pytest.raises(FaultSpecError, match=message):
            parse_faults(spec)
