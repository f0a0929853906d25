"""The embedded CPU core split (grpo_core.vllm_server.cpu_placement): which cores each side gets, the environment each
process is started with, when a launcher places at all, and that ``forked_on`` places the child, not the
parent."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from grpo_core.vllm_server.cpu_placement import (
    ROLLOUT_CPUS_ENV,
    CpuPlacement,
    embedded_placement,
    forked_on,
    format_cpus,
    parse_cpus,
    resolve_placement,
    rollout_cpus_from_env,
)


@pytest.mark.parametrize("ids,text", [([0], "0"), ([0, 1, 2, 5], "0-2,5"), ([3, 1, 2], "1-3"), ([0, 2, 4], "0,2,4"), ([], "")])
def test_cpu_lists_round_trip(ids: list[int], text: str) -> None:
    assert format_cpus(ids) == text
    assert parse_cpus(text) == tuple(sorted(ids))


@pytest.mark.parametrize("bad", ["3-1", "-1", "a"])
def test_a_bad_cpu_list_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_cpus(bad)


def test_two_cores_put_the_trainer_alone_on_core_1() -> None:
    p = embedded_placement([0, 1])
    assert (p.trainer, p.generation, p.engine) == ((1,), (0,), (0,))
    assert p.trainer_environment() == {"OMP_NUM_THREADS": "1", ROLLOUT_CPUS_ENV: "0"}


def test_more_cores_split_in_half_and_leave_the_server_front_a_core() -> None:
    p = embedded_placement(range(8))
    assert (p.trainer, p.generation, p.engine) == ((4, 5, 6, 7), (0, 1, 2, 3), (0, 1, 2))
    assert p.trainer_threads(1) == 4 and p.trainer_threads(2) == 2 and p.trainer_threads(8) == 1
    assert p.trainer_environment(2)["OMP_NUM_THREADS"] == "2"


def test_odd_and_sparse_core_sets_give_generation_the_extra_core() -> None:
    p = embedded_placement([2, 3, 7])  # a process confined to three cores (taskset, a cgroup)
    assert (p.trainer, p.generation, p.engine) == ((7,), (2, 3), (2,))


def test_one_core_is_not_split() -> None:
    assert embedded_placement([0]) is None


@pytest.mark.parametrize("kwargs", [
    dict(trainer=(), generation=(0,), engine=(0,)),
    dict(trainer=(1,), generation=(1,), engine=(1,)),
    dict(trainer=(1,), generation=(0,), engine=(2,)),
])
def test_an_inconsistent_placement_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CpuPlacement(**kwargs)


@pytest.mark.parametrize("mode,cuda,here,placed", [
    ("auto", False, True, True), ("off", False, True, False), ("auto", True, True, False), ("auto", False, False, False),
])
def test_only_a_cpu_run_with_its_own_server_is_placed(mode: str, cuda: bool, here: bool, placed: bool) -> None:
    p = resolve_placement(mode, cuda=cuda, server_started_here=here, cpus=[0, 1])
    assert (p is not None) == placed


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="auto"):
        resolve_placement("on", cuda=False, server_started_here=True, cpus=[0, 1])  # type: ignore[arg-type]


def test_the_rollout_cores_come_from_the_environment() -> None:
    assert rollout_cpus_from_env({}) is None
    assert rollout_cpus_from_env({ROLLOUT_CPUS_ENV: " "}) is None
    assert rollout_cpus_from_env({ROLLOUT_CPUS_ENV: "0-1"}) == (0, 1)


def test_forked_on_places_the_child_and_gives_the_parent_thread_its_cores_back() -> None:
    mine = sorted(os.sched_getaffinity(0))
    target = mine[-1:]
    other_thread: list[set[int]] = []
    with forked_on(target):
        out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                             capture_output=True, text=True, check=True).stdout
        t = threading.Thread(target=lambda: other_thread.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
    assert out.strip() == str(target)
    assert other_thread == [set(target)]  # a thread started inside the block inherits the cores too
    assert sorted(os.sched_getaffinity(0)) == mine


def test_forked_on_none_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with forked_on(None):
        assert os.sched_getaffinity(0) == before


def test_forked_on_cores_the_machine_lacks_starts_the_child_unplaced() -> None:
    before = os.sched_getaffinity(0)
    with forked_on([4096]):  # no such core
        assert os.sched_getaffinity(0) == before
    assert os.sched_getaffinity(0) == before
