"""The shm budget knows /dev/shm: the effective budget is the smaller of --shm-budget and what
the filesystem can hold, and a refusal names the limit that binds and the setting to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchd_server.errors import ResourceExhausted
from batchd_server.shm import ShmRegistry
from batchd_server.shm.settings import MIN_SESSION_BYTES, ShmSettings

import shmns

MiB = 1 << 20

_SCRIPT = """
import json
from batchd_server.errors import ResourceExhausted
from batchd_server.shm import ShmRegistry

MiB = 1 << 20
out = {}
with ShmRegistry(budget_bytes=1 << 30) as roomy:
    out["effective"] = roomy.effective_budget_bytes()
    try:
        roomy.create("ring", 100 * MiB, purpose="ring of 6 slots of 16.7 MiB")
    except ResourceExhausted as e:
        out["fs_limit"] = str(e)
    held = roomy.create("ring", 40 * MiB, purpose="a ring that fits")
    out["effective_while_held"] = roomy.effective_budget_bytes()
    roomy.release(held)
with ShmRegistry(budget_bytes=8 * MiB) as tight:
    out["tight_effective"] = tight.effective_budget_bytes()
    try:
        tight.create("ring", 16 * MiB, purpose="ring of 4 slots of 4.0 MiB")
    except ResourceExhausted as e:
        out["budget_limit"] = str(e)
with ShmRegistry(budget_bytes=1 << 30) as cached:
    cached.set_aside(40 * MiB, purpose="the decode cache (--decode-cache-size)", used=lambda: 0)
    try:
        cached.create("ring", 30 * MiB, purpose="ring of 6 slots of 5.0 MiB")
    except ResourceExhausted as e:
        out["cache_kept"] = str(e)
print(json.dumps(out))
"""


def test_the_effective_budget_is_the_smaller_of_the_flag_and_what_dev_shm_holds() -> None:
    """Under a 64 MB /dev/shm a 1 GiB budget is really 64 MiB; a session over it is refused
    naming /dev/shm, its size, the need and shm_size/sizeLimit, never --shm-budget as the
    fix; when the budget is the smaller limit, the message names --shm-budget instead."""
    reason = shmns.unavailable_reason()
    if reason is not None:
        pytest.skip(f"cannot mount a private 64 MB tmpfs on /dev/shm: {reason}")
    child = shmns.run_with_small_shm(_SCRIPT, size="64m")
    assert child.returncode == 0, f"exit {child.returncode} (-7 is SIGBUS): {child.stderr}"
    out = json.loads(child.stdout)
    assert out["effective"] == 64 * MiB
    assert out["effective_while_held"] == 64 * MiB, "our own segments stay in the budget"
    fs_limit = out["fs_limit"]
    assert fs_limit.startswith("/dev/shm has 64.0 MiB free; this session needs 100.0 MiB")
    assert "/dev/shm is 64.0 MiB in all" in fs_limit
    assert "not --shm-budget" in fs_limit and "Raise the budget" not in fs_limit
    assert "shm_size: 1gb" in fs_limit and "sizeLimit: 1Gi" in fs_limit

    kept = out["cache_kept"]  # 64 MiB free, 40 of them the cache's to fill: 30 do not fit
    assert kept.startswith(
        "/dev/shm has 64.0 MiB free, of which 40.0 MiB is kept for the decode cache "
        "(--decode-cache-size) to fill; this session needs 30.0 MiB"
    ), kept

    assert out["tight_effective"] == 8 * MiB
    budget_limit = out["budget_limit"]
    assert "budget of 8.0 MiB" in budget_limit and "--shm-budget" in budget_limit


def test_a_budget_refusal_names_what_the_decode_cache_set_aside(tmp_path: Path) -> None:
    """With the cache holding most of the budget and no segment, the refusal says where the
    bytes went ("0 segment(s)" alone reads as a leak) and that a smaller cache is a way out."""
    with ShmRegistry(budget_bytes=64 * MiB, shm_dir=tmp_path) as registry:
        registry.set_aside(
            60 * MiB, purpose="the decode cache (--decode-cache-size)", used=lambda: 0
        )
        with pytest.raises(ResourceExhausted) as refused:
            registry.create("ring", 8 * MiB, purpose="ring of 4 slots of 2.0 MiB")
    message = str(refused.value)
    assert (
        "0 B is reserved by 0 segment(s) and 60.0 MiB is set aside for the decode cache "
        "(--decode-cache-size), and ring of 4 slots of 2.0 MiB needs 8.0 MiB more" in message
    ), message
    assert "give the decode cache less" in message


@pytest.mark.parametrize(
    ("budget", "cache", "left"),
    [(1 << 30, 1 << 30, "0 B"), (1 << 30, 1000 * MiB, "24.0 MiB"), (64 * MiB, 96 * MiB, "0 B")],
)
def test_a_set_aside_that_leaves_no_room_for_a_session_is_a_problem(
    budget: int, cache: int, left: str
) -> None:
    settings = ShmSettings(shm_budget_bytes=budget)
    problem = settings.set_aside_problem(budget, cache, purpose="the decode cache", flag="--dc")
    assert problem is not None and f"which leaves {left} for the sessions'" in problem
    assert "one session needs 56.0 MiB (--min-free-shm" in problem
    assert settings.set_aside_problem(budget, budget - 56 * MiB, purpose="x", flag="--x") is None
    small = ShmSettings(shm_budget_bytes=budget, min_free_shm_bytes=0)
    assert small.session_bytes() == MIN_SESSION_BYTES, "never less than the least ring"


def test_a_budget_cut_by_the_shm_directory_says_so() -> None:
    settings = ShmSettings(shm_budget_bytes=1 << 30)
    problem = settings.set_aside_problem(56 * MiB, 48 * MiB, purpose="the cache", flag="--dc")
    assert problem is not None
    assert "(--shm-budget is 1.0 GiB, but /dev/shm holds less)" in problem, problem
