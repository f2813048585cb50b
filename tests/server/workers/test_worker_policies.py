"""The worker pool's rules, as pure functions: how a task that overran its deadline is redone
(``workers/deadline.py``), when a dead worker is replaced and when the pool is in a crash
loop (``workers/respawn.py``), and the server options that set them. The pool applying them
to real processes is tested in ``test_pool_dispatch.py`` and end to end
(``tests/e2e/test_deadlines.py``, ``test_worker_crash_loop.py``)."""

from __future__ import annotations

from collections import Counter

import pytest

from batchd_server.cli import build_parser
from batchd_server.config import ServerConfig
from batchd_server.workers import respawn
from batchd_server.workers.deadline import (
    BATCH_STEP,
    MAX_TIMEOUTS_PER_TASK,
    NOT_BEGUN,
    HungBatch,
    after_timeout,
)
from batchd_server.workers.respawn import RespawnPolicy
from batchd_server.workers.task import BatchTask, SessionSpec, SourceSpec

SPEC = SessionSpec(
    session_id="s1",
    pipeline_kind="array",
    pipeline_options={},
    ring_segment="r",
    header_bytes=4096,
    slot_bytes=4096,
    fields=(),
    batch_size=4,
    seed=0,
    on_error="skip",
    sources=(SourceSpec(catalog_segment="c", root="/data/set"),),
)
TASK = BatchTask(SPEC, epoch=0, batch_index=7, slot=1, positions=b"")


def _hang(task: BatchTask, hung_at: Counter[int], position: int) -> BatchTask:
    hung_at[position] += 1
    return after_timeout(task, hung_at, position, timeout_s=60.0)


def test_a_batch_wide_hang_is_redone_one_sample_at_a_time() -> None:
    task = _hang(TASK, Counter(), BATCH_STEP)
    assert task.one_by_one and task.hung == ()


def test_a_sample_is_retried_once_and_given_up_when_it_hangs_again() -> None:
    """First hang at a sample: the same task again. Second: the sample is marked hung (the
    worker reports it as kind timeout), the other samples are still decoded."""
    hung_at: Counter[int] = Counter()
    again = _hang(TASK, hung_at, 5)
    assert again == TASK
    given_up = _hang(again, hung_at, 5)
    assert given_up.hung == (5,) and given_up.one_by_one
    # Another sample hanging later is given its own retry.
    assert _hang(given_up, hung_at, 6).hung == (5,)


def test_a_task_its_worker_never_began_is_redone_as_it_was_yet_counts_towards_the_limit() -> None:
    """A worker stopped (SIGSTOP) before it began the task: no sample and no batch step is
    blamed, so the redo is the same task, not a slow one-sample-at-a-time one; but the
    deadlines still count, so a task cannot be redone forever."""
    hung_at: Counter[int] = Counter()
    for _ in range(MAX_TIMEOUTS_PER_TASK - 1):
        assert _hang(TASK, hung_at, NOT_BEGUN) == TASK
    with pytest.raises(HungBatch) as raised:
        _hang(TASK, hung_at, NOT_BEGUN)
    assert raised.value.positions == ()


def test_a_task_that_keeps_hanging_fails_as_a_whole_naming_where() -> None:
    hung_at: Counter[int] = Counter()
    task = TASK
    for position in [BATCH_STEP, 2, 2, 3][: MAX_TIMEOUTS_PER_TASK - 1]:
        task = _hang(task, hung_at, position)
    with pytest.raises(HungBatch) as raised:
        _hang(task, hung_at, 3)
    assert raised.value.positions == (2, 3)
    message = str(raised.value)
    for needed in ("batch 7", "s1", "60 s", "/data/set", "--task-timeout-s"):
        assert needed in message, message


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_death_is_replaced_at_once_and_a_burst_backs_off_exponentially() -> None:
    clock = _Clock()
    policy = RespawnPolicy(clock)
    delays = [policy.died(before_ready=False, how="signal SIGKILL") for _ in range(8)]
    first = respawn.FIRST_DELAY_S
    assert delays[:4] == [0.0, first, 2 * first, 4 * first]
    assert delays[-1] == respawn.MAX_DELAY_S and delays == sorted(delays)
    clock.now += respawn.WINDOW_S + 1  # the burst is over: a lone death is free again
    assert policy.died(before_ready=False, how="exit code 1") == 0.0
    assert policy.crash_loop is None, "workers that died while serving are no crash loop"


def test_workers_dying_before_ready_make_a_crash_loop_until_one_gets_ready() -> None:
    policy = RespawnPolicy(_Clock())
    for _ in range(respawn.CRASH_LOOP_STARTS - 1):
        policy.died(before_ready=True, how="exit code 1")
    assert policy.crash_loop is None
    policy.died(before_ready=True, how="exit code 1")
    reason = policy.crash_loop
    assert reason is not None
    for needed in ("crash loop", "exit code 1", "installed"):
        assert needed in reason, reason
    policy.ready()
    assert policy.crash_loop is None
    policy.died(before_ready=True, how="exit code 1")
    assert policy.crash_loop is None, "the count starts over after a worker got ready"


def test_a_failed_spawn_counts_as_a_death_before_ready_and_is_never_retried_at_once() -> None:
    """fork's EAGAIN for a replacement: a pause of at least the first backoff, growing with
    each failure, and a crash loop after enough of them in a row, naming the error."""
    policy = RespawnPolicy(_Clock())
    error = "BlockingIOError: [Errno 11] Resource temporarily unavailable"
    delays = [policy.spawn_failed(error) for _ in range(respawn.CRASH_LOOP_STARTS)]
    assert delays[0] == respawn.FIRST_DELAY_S and delays == sorted(delays), delays
    assert delays[-1] > delays[0]
    reason = policy.crash_loop
    assert reason is not None and "a failed start" in reason and "Errno 11" in reason, reason
    policy.ready()
    assert policy.crash_loop is None


def test_the_deadline_options_come_from_flags_or_the_environment() -> None:
    url = "sqlite:///x.db"
    config = ServerConfig.from_env(
        {"BATCHD_TASK_TIMEOUT_S": "7.5", "BATCHD_HEARTBEAT_INTERVAL_S": "0"}, database_url=url
    )
    assert (config.task_timeout_s, config.heartbeat_interval_s) == (7.5, 0.0)
    defaults = ServerConfig(database_url=url)
    assert (defaults.task_timeout_s, defaults.heartbeat_interval_s) == (60.0, 5.0)
    with pytest.raises(ValueError, match="--task-timeout-s"):
        ServerConfig(database_url=url, task_timeout_s=0)
    with pytest.raises(ValueError, match="--heartbeat-interval-s"):
        ServerConfig(database_url=url, heartbeat_interval_s=-1)
    args = build_parser().parse_args(
        ["serve", "--task-timeout-s", "9", "--heartbeat-interval-s", "2.5"]
    )
    assert (args.task_timeout_s, args.heartbeat_interval_s) == (9.0, 2.5)
