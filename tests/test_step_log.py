"""Engine step times (`worker.step_log`): what the plugin records, and how it reads back."""

from types import SimpleNamespace

import pytest

from worker import step_log


def test_steps_read_back_by_window_and_one_request_decode_steps_summarised(tmp_path):
    (tmp_path / "steps-1.txt").write_text(
        "10.000 10.003 1 1\n"   # one request decoding: 3 ms
        "10.010 10.014 1 1\n"   # 4 ms
        "10.020 10.040 600 2\n"  # a prefill beside a decode: not a decode step
        "11.000 11.100 1 1\n"   # outside the window below
        "12.000 12.0")           # cut short by the process's end
    (tmp_path / "steps-2.txt").write_text("10.030 10.035 2 2\n")
    steps = step_log.read(tmp_path, 10.0, 10.5)
    assert [s.tokens for s in steps] == [1, 1, 600, 2]  # in order of start, both files
    assert step_log.summary(steps) == {"decode1_ms": pytest.approx(3.5), "steps": 4.0}
    assert step_log.summary([])["steps"] == 0.0


def test_install_times_every_step_that_scheduled_tokens(tmp_path):
    plans = iter([(1, 1), (0, 0), (64, 2)])

    class Scheduler:  # vLLM's, as far as the log reads it
        def schedule(self):
            tokens, requests = next(plans)
            return SimpleNamespace(total_num_scheduled_tokens=tokens,
                                   num_scheduled_tokens=dict.fromkeys(range(requests), 1))

    class EngineCore:
        def __init__(self):
            self.scheduler = Scheduler()

        def step(self):
            return self.scheduler.schedule()

    step_log.install(str(tmp_path), Scheduler, EngineCore)
    step_log.install(str(tmp_path), Scheduler, EngineCore)  # idempotent: one line per step
    core = EngineCore()
    for _ in range(3):
        core.step()
    steps = step_log.read(tmp_path)  # each step's line is there once it ended
    assert [(s.tokens, s.requests) for s in steps] == [(1, 1), (64, 2)]  # the empty step not
    assert all(s.end >= s.start for s in steps)
