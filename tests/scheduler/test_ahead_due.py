"""When the scheduler stage builds the step after the one in flight (`SchedulerService._ahead_due`):
late in that step, so that it takes in what arrived meanwhile, early enough to be ready before it ends."""

from collections import deque
from types import SimpleNamespace

from services.scheduler import service
from services.scheduler.service import SchedulerService, StepInFlight


def stage(in_flight: int = 1, last_step_s: float | None = 0.033, result_at: float | None = 100.0,
          started: float = 99.0, async_scheduling: bool = True, executor_lost: str | None = None,
          ahead_fraction: float = 0.8, ahead_long_prompts: float = 0.5, prompt_average: float = 1800.0,
          budget: int = 2048, scheduler_up: bool = True):
    steps = deque(StepInFlight(i, [], started) for i in range(in_flight))
    args = SimpleNamespace(async_scheduling=async_scheduling, ahead_fraction=ahead_fraction,
                           ahead_long_prompts=ahead_long_prompts)
    scheduler = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=budget)) if scheduler_up else None
    return SimpleNamespace(in_flight=steps, args=args, scheduler=scheduler, prompt_average=prompt_average,
                           executor_lost=executor_lost, result_at=result_at, last_step_s=last_step_s)


def due(**kwargs) -> float | None:
    st = stage(**kwargs)
    st._began = lambda step: SchedulerService._began(st, step)
    st._prompts_long = lambda: SchedulerService._prompts_long(st)
    return SchedulerService._ahead_due(st)


def test_built_late_in_the_step_in_flight():
    # the step in flight began when the result before it came (100.0): its successor is built
    # --ahead-fraction of the last step's time into it
    assert due(last_step_s=0.025) == 100.0 + 0.8 * 0.025
    # sent after that result (built at once, not ahead): it began when it was sent
    assert due(started=100.5, last_step_s=0.025) == 100.5 + 0.8 * 0.025
    assert due(last_step_s=0.025, ahead_fraction=0.0) == 100.0  # as the step starts


def test_long_steps_wait_at_most_the_cap():
    assert due(last_step_s=1.2) == 100.0 + service.AHEAD_MAX_DELAY_S


def test_short_or_unknown_steps_get_their_successor_at_once():
    assert due(last_step_s=0.006) == 100.0  # a C=1 decode step: nothing to wait for
    assert due(last_step_s=None, result_at=None, started=7.0) == 7.0


def test_none_unless_one_step_in_flight_with_async_scheduling():
    assert due(in_flight=0) is None
    assert due(in_flight=2) is None
    assert due(async_scheduling=False) is None
    assert due(executor_lost="no answer") is None


def test_built_late_only_while_prompts_are_long():
    # prompts averaging half the step budget or more cannot share a step: built late
    assert due(last_step_s=0.025, prompt_average=1024.0) == 100.0 + 0.8 * 0.025
    # short ones share steps: built as the step in flight starts, as without --ahead-fraction
    assert due(last_step_s=0.025, prompt_average=150.0) == 100.0
    assert due(last_step_s=0.025, prompt_average=150.0, budget=256) == 100.0 + 0.8 * 0.025
    # --ahead-long-prompts 0: late whatever the prompts
    assert due(last_step_s=0.025, prompt_average=0.0, ahead_long_prompts=0.0) == 100.0 + 0.8 * 0.025
    assert due(last_step_s=0.025, prompt_average=1800.0, scheduler_up=False) == 100.0


def test_prompt_average_follows_the_requests_received():
    st = stage(prompt_average=0.0)
    st._prompts_long = lambda: SchedulerService._prompts_long(st)
    for n in [1800] * 4:
        SchedulerService._note_prompt(st, n)
    assert st._prompts_long()  # a few long prompts in a row make them long
    for n in [100] * 4:
        SchedulerService._note_prompt(st, n)
    assert not st._prompts_long()
    assert 100 < st.prompt_average < 1024
