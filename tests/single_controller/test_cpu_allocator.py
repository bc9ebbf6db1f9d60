"""CPU worker groups start their workers with glibc malloc settings that keep freed memory
(verl/single_controller/ray/cpu_allocator.py): which groups get them, when the user's choice wins,
and that a worker then re-allocates freed tensors without faulting its pages in again."""

from __future__ import annotations

import os
import platform
import resource
import sys

import pytest
from ray import cloudpickle

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.cpu_allocator import CPU_WORKER_MALLOC_ENV, TUNING_SWITCH, cpu_worker_malloc_env

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_cpu_groups_get_the_settings_and_gpu_groups_do_not(monkeypatch):
    monkeypatch.delenv(TUNING_SWITCH, raising=False)
    assert cpu_worker_malloc_env(False, {"PATH": "/bin"}, {}) == CPU_WORKER_MALLOC_ENV
    assert set(CPU_WORKER_MALLOC_ENV) == {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}
    assert cpu_worker_malloc_env(True, {}) == {}


@pytest.mark.parametrize("where", [0, 1, 2])
def test_any_malloc_variable_of_the_user_means_none_of_ours(monkeypatch, where):
    monkeypatch.delenv(TUNING_SWITCH, raising=False)
    envs = [{}, {}, {}]
    envs[where] = {"MALLOC_ARENA_MAX": "2"}
    assert cpu_worker_malloc_env(False, *envs) == {}


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("1", True), ("TRUE", True)])
def test_the_switch_turns_it_off_and_on(monkeypatch, value, on):
    monkeypatch.setenv(TUNING_SWITCH, value)
    assert cpu_worker_malloc_env(False, {}) == (CPU_WORKER_MALLOC_ENV if on else {})


def test_a_switch_that_is_not_one_says_what_to_set(monkeypatch):
    monkeypatch.setenv(TUNING_SWITCH, "maybe")
    with pytest.raises(ValueError, match=r"VERL_CPU_MALLOC_TUNING='maybe' is not a switch; set it to 1 .* or 0"):
        cpu_worker_malloc_env(False, {})


class FaultWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def malloc_env(self) -> dict:
        return {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def faults_per_round(self, megabytes: list[int], repeats: int) -> float:
        """Minor page faults per round of allocate-fill-free of tensors of `megabytes` each, as a
        step allocates and frees its activations, after warm-up rounds (a step has run before)."""
        import torch

        def once(mb):
            torch.empty(mb * 2**18).fill_(1.0)  # float32: 2**18 per MB; freed at once

        for mb in range(2, 2 * max(megabytes) + 1, 2):  # the heap grows to the step's peak once
            once(mb)
        for _ in range(2):
            for mb in megabytes:
                once(mb)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(repeats):
            for mb in megabytes:
                once(mb)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats


# Blocks above glibc's largest adaptive mmap threshold (32 MiB on 64-bit): with its defaults each one
# always gets a fresh mapping, unmapped when freed, whatever the process allocated before. Smaller
# blocks (4-16 MB) fault or not depending on the worker's heap history (glibc raises its threshold to
# the largest mapped block freed so far): a suite run once measured 0 faults per round for them.
_BLOCKS_MB = [40, 48]


def _faults_and_env(worker_env=None) -> tuple[list[float], list[dict]]:
    pool = RayResourcePool([1], use_gpu=False)
    wg = RayWorkerGroup(pool, RayClassWithInitArgs(FaultWorker), worker_env=worker_env)
    try:
        return wg.faults_per_round(_BLOCKS_MB, 4), wg.malloc_env()
    finally:
        wg.shutdown()
        pool.remove_placement_groups()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_a_cpu_worker_reallocates_freed_tensors_without_page_faults(ray_session, monkeypatch):
    monkeypatch.delenv(TUNING_SWITCH, raising=False)
    for name in [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    tuned, tuned_env = _faults_and_env()
    monkeypatch.setenv(TUNING_SWITCH, "0")
    default, default_env = _faults_and_env()
    assert tuned_env == [CPU_WORKER_MALLOC_ENV] and default_env == [{}]
    # with glibc's defaults both blocks get a fresh mapping each time and their pages are faulted in
    # again every round: 22.5K 4-KiB pages, or at least one fault per 2 MiB (44) with transparent huge
    # pages; the tuned worker takes them from its kept heap
    assert default[0] > 40, f"with glibc's defaults: {default[0]:.0f} faults per round of 40 + 48 MB"
    assert tuned[0] < default[0] / 10, f"faults per round of 40 + 48 MB: tuned {tuned[0]:.0f}, default {default[0]:.0f}"


def test_a_malloc_setting_in_worker_env_is_kept_alone(ray_session, monkeypatch):
    monkeypatch.delenv(TUNING_SWITCH, raising=False)
    _, env = _faults_and_env({"MALLOC_ARENA_MAX": "2"})
    assert env == [{"MALLOC_ARENA_MAX": "2"}]
