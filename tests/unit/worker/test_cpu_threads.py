"""The worker's CPU threads: no more than the cores it may use (affinity and
cgroup quota), and OpenMP threads that spin only briefly unless the operator
chose otherwise (services/worker/__init__.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.worker.platforms import base as platforms_base, select_platform


@pytest.mark.parametrize(("usable", "expected"), [(3, 3), (6, 6), (8, 6)])
def test_by_default_a_worker_runs_no_more_threads_than_the_cores_it_may_use(usable, expected, monkeypatch):
    set_to = []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 6)
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(platforms_base, "usable_cpus", lambda: usable)
    select_platform("cpu").set_num_threads(0, 1)
    assert (set_to or [torch.get_num_threads()]) == [expected]


@pytest.mark.parametrize(("files", "expected"), [
    ({"cpu.max": "250000 100000\n"}, 2.5),  # cgroup v2, a limit of 2.5 CPUs
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "400000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 4.0),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cgroup_cpu_quota_is_read_from_either_cgroup_version(files, expected, tmp_path):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert platforms_base.cgroup_cpu_quota(str(tmp_path)) == expected


def test_a_quota_below_the_affinity_caps_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(platforms_base, "cgroup_cpu_quota", lambda: 3.7)
    assert platforms_base.usable_cpus() == 3
    monkeypatch.setattr(platforms_base, "cgroup_cpu_quota", lambda: 0.5)
    assert platforms_base.usable_cpus() == 1
    monkeypatch.setattr(platforms_base, "cgroup_cpu_quota", lambda: None)
    assert platforms_base.usable_cpus() == 16


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, "10000"), ({"GOMP_SPINCOUNT": "300000"}, "300000"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None)])
def test_the_worker_spins_briefly_unless_the_operator_chose(environ, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import services.worker, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env={**env, **environ}, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[3]).stdout.strip()
    assert out == str(expected)

