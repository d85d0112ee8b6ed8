"""The CPU worker's thread pool size (kestrel/distributed/thread_governor.py): the usable cores at start
(affinity, cgroup quota from a fake cgroup folder, one left to the front end from 4 cores up), the
contention detector fed synthetic /proc/stat and process readings, its hysteresis, the worker applying
the count between steps only, and the pinned switch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kestrel.distributed import thread_governor as tg
from kestrel.distributed.thread_governor import (
    CpuReading,
    ThreadCountPolicy,
    ThreadGovernor,
    busy_seconds,
    cgroup_cpu_limit,
    kestrel_pids,
    neighbour_cores,
    pool_size_at_start,
    process_cpu_seconds,
    usable_cores,
)

# ---- cores at start -----------------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_read_along_the_path(tmp_path):
    write(tmp_path / "cpu.max", "max 100000\n")
    write(tmp_path / "kestrel.slice" / "cpu.max", "250000 100000\n")
    write(tmp_path / "kestrel.slice" / "worker" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/kestrel.slice/worker\n") == 2.5


def test_cgroup_v2_without_quota(tmp_path):
    write(tmp_path / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/\n") is None


def test_cgroup_v2_path_missing_inside_a_container_reads_the_mount(tmp_path):
    write(tmp_path / "cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(tmp_path, "0::/somewhere/on/the/host\n") == 1.5


def test_cgroup_v1_quota(tmp_path):
    write(tmp_path / "cpu,cpuacct" / "docker" / "cpu.cfs_quota_us", "300000\n")
    write(tmp_path / "cpu,cpuacct" / "docker" / "cpu.cfs_period_us", "100000\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    text = "5:memory:/docker\n3:cpu,cpuacct:/docker\n0::/\n"
    assert cgroup_cpu_limit(tmp_path, text) == 3.0


def test_cgroup_v1_unlimited(tmp_path):
    write(tmp_path / "cpu" / "cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "cpu" / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path, "2:cpu:/\n") is None


def test_this_machine_has_a_readable_cgroup_answer():
    limit = cgroup_cpu_limit()
    assert limit is None or limit > 0


@pytest.mark.parametrize(("affinity", "limit", "expected"), [
    (8, None, 8), (8, 2.5, 2), (8, 0.5, 1), (2, 16.0, 2), (4, 4.0, 4)])
def test_usable_cores_is_affinity_capped_by_whole_quota_cores(affinity, limit, expected):
    assert usable_cores(affinity, limit) == expected


@pytest.mark.parametrize(("usable", "leave", "expected"), [
    (2, True, 2), (3, True, 3), (4, True, 3), (16, True, 15), (16, False, 16), (1, True, 1)])
def test_one_core_is_left_to_the_front_end_from_four_up(usable, leave, expected):
    assert pool_size_at_start(usable, leave) == expected


# ---- readings -----------------------------------------------------------------------------------

PROC_STAT = """cpu  1000 10 500 9000 50 5 5 20 0 0
cpu0 400 5 200 4500 25 2 3 10 0 0
cpu1 600 5 300 4500 25 3 2 10 0 0
cpu2 900 0 0 100 0 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_sums_the_busy_columns_of_the_watched_cpus():
    # cpu0: 400+5+200+2+3+10 = 620 ticks; cpu1: 600+5+300+3+2+10 = 920 ticks (idle and iowait left out).
    assert busy_seconds(PROC_STAT, [0], 100) == pytest.approx(6.2)
    assert busy_seconds(PROC_STAT, [0, 1], 100) == pytest.approx(15.4)
    assert busy_seconds(PROC_STAT, [2], 100) == pytest.approx(9.0)


def test_process_cpu_seconds_reads_utime_and_stime(tmp_path):
    fields = ["S", "1", "2", "3"] + ["0"] * 7 + ["150", "50"] + ["0"] * 30
    write(tmp_path / "42" / "stat", "42 (python3 -m kestrel (x)) " + " ".join(fields))
    assert process_cpu_seconds(42, tmp_path, ticks_per_s=100) == pytest.approx(2.0)
    assert process_cpu_seconds(43, tmp_path, ticks_per_s=100) == 0.0  # gone


def test_own_process_cpu_time_is_counted():
    spent = process_cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert process_cpu_seconds(os.getpid()) > spent


def fake_proc(tmp_path: Path, parents: dict[int, int]) -> Path:
    for pid, ppid in parents.items():
        write(tmp_path / str(pid) / "stat", f"{pid} (python) S {ppid} " + " ".join(["0"] * 40))
    return tmp_path


def test_kestrel_pids_walk_up_to_the_front_end(tmp_path):
    proc = fake_proc(tmp_path, {300: 200, 200: 100, 100: 50, 50: 1})
    assert kestrel_pids(300, 100, proc) == [300, 200, 100]     # worker, engine core, API server
    assert kestrel_pids(300, 300, proc) == [300]               # the worker is the front end
    assert kestrel_pids(300, None, proc) == [300]
    assert kestrel_pids(300, 999, proc) == [300]               # not an ancestor: only itself


def test_real_ancestors_are_found():
    assert kestrel_pids(os.getpid(), os.getppid()) == [os.getpid(), os.getppid()]


# ---- the decision -------------------------------------------------------------------------------

def reading(t: float, busy: float, own: float) -> CpuReading:
    return CpuReading(t, busy, own)


def test_neighbour_cores_is_busy_time_not_ours_per_second():
    # 2 cores fully busy for 1 s, 0.7 s of it ours: neighbours took 1.3 cores.
    assert neighbour_cores(reading(0, 10, 5), reading(1, 12, 5.7)) == pytest.approx(1.3)
    # Our processes may run on cores outside the watched ones: never below 0.
    assert neighbour_cores(reading(0, 10, 5), reading(1, 10.5, 6)) == 0.0


def test_policy_shrinks_on_two_cores_when_a_neighbour_takes_one():
    policy = ThreadCountPolicy(2, 2)
    assert policy.next_count(2, 0.67) == 1   # time-shared with our 2 spinning threads, it gets 2/3 of a core
    assert policy.next_count(1, 1.0) == 1    # with one thread it has its core, and we stay at 1
    assert policy.next_count(2, 0.3) == 2    # a light neighbour is not worth a core


def test_policy_grows_back_only_after_calm_checks_in_a_row():
    policy = ThreadCountPolicy(2, 2)
    assert policy.next_count(1, 0.0) == 1
    assert policy.next_count(1, 1.0) == 1    # the neighbour is back: the calm count starts over
    assert policy.next_count(1, 0.1) == 1
    assert policy.next_count(1, 0.0) == 2


def test_policy_band_between_shrink_and_grow_holds_the_count():
    policy = ThreadCountPolicy(2, 2)
    for _ in range(5):
        assert policy.next_count(1, 0.45) == 1   # 1.55 free: not enough to grow
        assert policy.next_count(2, 0.45) == 2   # 1.55 free: not little enough to shrink


def test_policy_on_many_cores_uses_the_reserved_core_first():
    policy = ThreadCountPolicy(7, 8)          # 8 usable, one left to the front end
    assert policy.next_count(7, 0.9) == 7     # one neighbour thread fits on the reserved core
    assert policy.next_count(7, 1.8) == 6     # two: the pool gives up one core
    assert policy.next_count(6, 3.9) == 4
    assert policy.next_count(4, 0.0) == 4
    assert policy.next_count(4, 0.0) == 7     # back to the most it may have, in one move


def test_policy_never_goes_below_one_thread():
    assert ThreadCountPolicy(2, 2).next_count(2, 5.0) == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedSampler:
    """Readings of a machine with `cores` cores, where neighbours take `neighbours` cores from now on."""

    def __init__(self, clock: FakeClock, cores: int) -> None:
        self.clock, self.cores = clock, cores
        self.busy = self.own = 0.0
        self.neighbours = 0.0
        self.last_t = 0.0
        self.calls = 0

    def __call__(self) -> CpuReading:
        self.calls += 1
        dt = self.clock.now - self.last_t
        self.last_t = self.clock.now
        self.busy += self.cores * dt                   # every core busy
        self.own += (self.cores - self.neighbours) * dt  # ours is what neighbours leave
        return CpuReading(self.clock.now, self.busy, self.own)


def governor_on(clock: FakeClock, sampler: ScriptedSampler, applied: list[int]) -> ThreadGovernor:
    return ThreadGovernor(2, ThreadCountPolicy(2, 2), sampler, applied.append, clock=clock, interval_s=0.5)


def run_steps(governor: ThreadGovernor, clock: FakeClock, seconds: float, step_s: float = 0.015) -> list[int]:
    counts = []
    end = clock.now + seconds
    while clock.now < end:
        counts.append(governor.between_steps())
        clock.now += step_s
    return counts


def test_governor_shrinks_under_a_neighbour_and_grows_back():
    clock, applied = FakeClock(), []
    sampler = ScriptedSampler(clock, 2)
    governor = governor_on(clock, sampler, applied)
    assert applied == [2]
    assert set(run_steps(governor, clock, 2.0)) == {2}
    sampler.neighbours = 0.7
    run_steps(governor, clock, 1.2)
    assert governor.threads == 1 and applied == [2, 1]
    sampler.neighbours = 1.0
    assert set(run_steps(governor, clock, 3.0)) == {1}
    sampler.neighbours = 0.0
    counts = run_steps(governor, clock, 2.0)
    assert counts[-1] == 2 and applied == [2, 1, 2]
    # It waited for two calm checks (>= 1 s of steps at 1 thread) before growing.
    assert counts.index(2) * 0.015 >= 0.5


def test_governor_checks_a_few_times_a_second_only():
    clock, applied = FakeClock(), []
    sampler = ScriptedSampler(clock, 2)
    governor = governor_on(clock, sampler, applied)
    steps = len(run_steps(governor, clock, 5.0))
    assert steps > 300 and 9 <= sampler.calls <= 11


def test_governor_takes_a_fresh_baseline_after_an_idle_gap():
    clock, applied = FakeClock(), []
    sampler = ScriptedSampler(clock, 2)
    governor = governor_on(clock, sampler, applied)
    run_steps(governor, clock, 1.0)
    sampler.neighbours = 2.0        # e.g. another engine's work while Kestrel was idle
    clock.now += 10.0
    sampler()                       # (the counters moved on while idle)
    sampler.neighbours = 0.0
    governor.between_steps()
    assert governor.threads == 2 and applied == [2]


def test_pinned_governor_never_samples():
    applied = []
    governor = ThreadGovernor(3, None, lambda: pytest.fail("sampled"), applied.append)
    assert [governor.between_steps() for _ in range(5)] == [3] * 5
    assert applied == [3] and not governor.adaptive and "pinned" in governor.describe()


def test_governor_for_worker_pinned_and_adaptive(monkeypatch, tmp_path):
    applied = []
    pinned = tg.governor_for_worker(1, leave_one_to_frontend=True, set_threads=applied.append, cgroup_root=tmp_path)
    assert pinned.threads == 1 and not pinned.adaptive
    cores = len(os.sched_getaffinity(0))
    adaptive = tg.governor_for_worker(None, leave_one_to_frontend=True, set_threads=applied.append,
                                      cgroup_root=tmp_path)
    assert adaptive.adaptive and adaptive.threads == pool_size_at_start(usable_cores(cores, None), True)
    assert applied == [1, adaptive.threads]
    adaptive.between_steps()   # a real /proc reading works
    assert adaptive.last is not None and adaptive.last.busy > 0 and adaptive.last.own > 0


# ---- in the worker ------------------------------------------------------------------------------

class RecordingGovernor:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def between_steps(self) -> int:
        self.log.append("between")
        return 1


class RecordingRunner:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def execute_model(self, scheduler_output):
        self.log.append("step")
        return scheduler_output


def test_worker_applies_the_count_before_each_step_not_inside():
    from kestrel.worker.worker import Worker
    log: list[str] = []
    worker = Worker.__new__(Worker)
    worker.threads = RecordingGovernor(log)
    worker.runner = RecordingRunner(log)
    assert worker.execute_model("out") == "out"
    worker.execute_model("out")
    assert log == ["between", "step", "between", "step"]


@pytest.fixture
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_setting(restore_torch_threads):
    from kestrel.engine.arg_utils import EngineArgs, check_settings, resolve_cpu_threads
    assert resolve_cpu_threads("auto") is None
    assert resolve_cpu_threads("3") == 3 and resolve_cpu_threads(2) == 2
    for bad in ("0", "many", -1, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            resolve_cpu_threads(bad)
    with pytest.raises(ValueError, match="cpu_threads"):
        check_settings(EngineArgs(cpu_threads="none"))


@pytest.mark.slow
def test_engine_worker_pins_or_adapts(restore_torch_threads):
    from kestrel import LLM, SamplingParams
    llm = LLM(cpu_threads=1, max_model_len=256, kv_cache_memory="64MiB")
    worker = llm.llm_engine.engine_core.executor.driver_worker
    assert worker.threads is not None and not worker.threads.adaptive and torch.get_num_threads() == 1
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_spawned_processes_log_only_under_a_program_that_logs(monkeypatch):
    import logging

    from kestrel.distributed.lifecycle import LOGGING_LEVEL_ENV, inherit_program_logging
    kestrel_logger = logging.getLogger("kestrel")
    handlers, level = list(kestrel_logger.handlers), kestrel_logger.level
    monkeypatch.setattr(kestrel_logger, "handlers", [])
    try:
        monkeypatch.delenv(LOGGING_LEVEL_ENV, raising=False)
        inherit_program_logging()
        assert kestrel_logger.handlers == []            # a library's processes: silent, as before
        monkeypatch.setenv(LOGGING_LEVEL_ENV, "debug")
        inherit_program_logging()
        assert len(kestrel_logger.handlers) == 1 and kestrel_logger.level == logging.DEBUG
        inherit_program_logging()
        assert len(kestrel_logger.handlers) == 1        # once
    finally:
        kestrel_logger.setLevel(level)
    assert kestrel_logger.handlers is not handlers
