"""`splitserve up`'s supervision policy without real services: RestartBudget's backoff and
crash-loop accounting, and Supervisor with fake processes and a fake clock."""

from __future__ import annotations

import pytest

from splitserve.launch import RestartBudget, RestartPolicy, Supervisor, exit_status


class FakeProc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        self.returncode = -sig

    def wait(self, timeout: float | None = None) -> int:
        assert self.returncode is not None
        return self.returncode


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fake_supervisor(policy: RestartPolicy | None) -> tuple[Supervisor, Clock, list[list[str]]]:
    clock, started = Clock(), []

    def start(argv):
        started.append(list(argv))
        return FakeProc(1000 + len(started))
    return Supervisor(policy, start=start, clock=clock), clock, started


def test_backoff_doubles_to_the_cap_then_a_crash_loop() -> None:
    budget = RestartBudget(RestartPolicy(backoff_s=1.0, max_backoff_s=5.0, max_restarts=5,
                                         window_s=60.0))
    verdicts = [budget.on_exit("decode-0", t) for t in (0.0, 1.0, 3.0, 7.0, 12.0, 17.0)]
    assert verdicts == [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (5, 5.0), None]


def test_each_service_counts_its_own_exits_and_the_window_forgets() -> None:
    budget = RestartBudget(RestartPolicy(backoff_s=0.5, max_restarts=2, window_s=10.0))
    assert budget.on_exit("decode-0", 0.0) == (1, 0.5)
    assert budget.on_exit("decode-1", 0.1) == (1, 0.5)
    assert budget.on_exit("decode-0", 5.0) == (2, 1.0)
    assert budget.on_exit("decode-0", 10.5) == (2, 1.0)  # the exit at 0.0 is out of the window
    assert budget.on_exit("decode-0", 11.0) is None
    assert budget.on_exit("decode-1", 30.0) == (1, 0.5)


def test_max_restarts_zero_gives_up_at_the_first_exit() -> None:
    assert RestartBudget(RestartPolicy(max_restarts=0)).on_exit("gateway", 0.0) is None


@pytest.mark.parametrize("kwargs", [{"backoff_s": -1.0}, {"backoff_s": 60.0},
                                    {"max_restarts": -1}, {"window_s": 0.0}])
def test_policy_is_validated(kwargs) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)


def test_a_dead_service_restarts_with_its_argv_after_the_backoff(capsys) -> None:
    sup, clock, started = fake_supervisor(RestartPolicy(backoff_s=1.0))
    sup.start("decode-0", ["splitserve", "decode", "--port", "0"])
    sup.start("decode-1", ["splitserve", "decode", "--port", "0", "--x"])
    dead = sup.procs[1]
    dead.returncode = -9
    assert sup.poll() is None
    assert "service exited: role=decode name=decode-1 pid=1002 exit=SIGKILL restart=1 in_s=1" in (
        capsys.readouterr().err)
    clock.now += 0.5
    assert sup.poll() is None and len(started) == 2  # still in its backoff
    clock.now += 0.5
    assert sup.poll() is None
    assert started[-1] == ["splitserve", "decode", "--port", "0", "--x"]
    assert sup.procs[1] is not dead and sup.procs[1].pid == 1003
    assert "service restarted: name=decode-1 pid=1003 restart=1" in capsys.readouterr().err


def test_a_crash_loop_stops_the_stack() -> None:
    sup, clock, started = fake_supervisor(RestartPolicy(backoff_s=0.0, max_restarts=2))
    sup.start("prefill-0", ["splitserve", "prefill"])
    reasons = []
    for _ in range(3):
        sup.procs[0].returncode = 1
        reasons.append(sup.poll())  # the exit
        clock.now += 0.1
        sup.poll()  # the restart
    assert reasons[:2] == [None, None]
    assert reasons[2] == "prefill-0 is crash-looping: 3 exits within 300 s (--max-restarts 2)"
    assert len(started) == 3


def test_stop_mode_reports_the_first_exit_and_restarts_nothing() -> None:
    sup, _, started = fake_supervisor(None)
    sup.start("gateway", ["splitserve", "gateway"])
    assert sup.poll() is None
    sup.procs[0].returncode = 3
    assert sup.poll() == "gateway (pid 1001) exited with 3"
    assert len(started) == 1


def test_stop_ends_every_child_and_none_restarts_after() -> None:
    sup, clock, started = fake_supervisor(RestartPolicy(backoff_s=0.0))
    for name in ("prefill-0", "decode-0", "gateway"):
        sup.start(name, ["splitserve", name.split("-")[0]])
    sup.procs[1].returncode = -9
    sup.poll()  # decode-0 now waits for its restart
    procs = sup.procs
    assert sup.stop() == [-15, -9, -15]
    assert [p.signals for p in procs] == [[15], [], [15]]
    clock.now += 10
    assert sup.poll() is None and len(started) == 3


def test_exit_status() -> None:
    assert [exit_status(c) for c in (0, 1, -9, -15, -99)] == ["0", "1", "SIGKILL", "SIGTERM",
                                                             "signal 99"]
