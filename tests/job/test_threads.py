"""The job's intra-op threads: one per core that the process may use and that other processes leave free."""

import pytest
import torch

from kimi_k3.job import threads


def fake_proc(tmp_path, cgroup_lines: str):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    return proc


def test_a_cgroup_v2_quota_lowers_the_usable_cores(tmp_path):
    proc = fake_proc(tmp_path, "0::/ci/job\n")
    root = tmp_path / "cgroup"
    (root / "ci" / "job").mkdir(parents=True)
    (root / "ci" / "job" / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_quota(proc, root) == 1.5
    assert threads.usable_cores(proc, root) == min(1.5, len(threads.os.sched_getaffinity(0)))
    (root / "ci" / "job" / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_quota(proc, root) is None
    assert threads.usable_cores(proc, root) == len(threads.os.sched_getaffinity(0))


def test_a_cgroup_v1_quota_lowers_the_usable_cores(tmp_path):
    proc = fake_proc(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/runner\n")
    folder = tmp_path / "cgroup" / "cpu,cpuacct" / "runner"
    folder.mkdir(parents=True)
    (folder / "cpu.cfs_quota_us").write_text("50000\n")
    (folder / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_quota(proc, tmp_path / "cgroup") == 0.5
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert threads.cgroup_cpu_quota(proc, tmp_path / "cgroup") is None


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert threads.cgroup_cpu_quota(tmp_path / "missing", tmp_path) is None


def test_busy_cores_are_the_median_runnable_tasks_other_than_the_reader(tmp_path):
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("7.01 5.02 3.00 3/154 13454\n")
    assert threads.busy_cores_of_others(loadavg, samples=3, interval_s=0) == 2
    assert threads.busy_cores_of_others(tmp_path / "missing", samples=3, interval_s=0) == 0


@pytest.mark.parametrize(
    "usable, busy, ceiling, expected",
    [
        (2, 0, 2, 2),  # idle: torch's own default
        (2, 1, 2, 1),  # one busy neighbour on 2 cores
        (2, 2, 2, 1),  # at least one
        (2, 5, 2, 1),
        (4, 1, 2, 2),  # never above torch's default (one per physical core)
        (1.5, 0, 4, 1),  # a quota of one and a half cores
        (8, 2.5, 8, 6),
    ],
)
def test_one_thread_per_core_the_others_leave_free(usable, busy, ceiling, expected):
    assert threads.default_threads(usable, busy, ceiling) == expected


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_choice_sets_torchs_threads_and_says_why_in_one_line(monkeypatch, torch_threads):
    monkeypatch.setattr(threads, "usable_cores", lambda: 2.0)
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: 1.0)
    torch.set_num_threads(2)
    line = threads.choose_intra_op_threads(environ={})
    assert torch.get_num_threads() == 1
    assert line == ("intra-op threads: 1 (2 usable cores, other processes' runnable tasks 1 at the start; "
                    "OMP_NUM_THREADS=N chooses, and a bit-for-bit resume needs the same count)")


def test_omp_num_threads_set_by_the_user_wins(monkeypatch, torch_threads):
    monkeypatch.setattr(threads, "busy_cores_of_others", lambda: pytest.fail("the run queue is not read"))
    torch.set_num_threads(2)
    line = threads.choose_intra_op_threads(environ={"OMP_NUM_THREADS": "2"})
    assert line == "intra-op threads: 2 (OMP_NUM_THREADS=2)"
    assert torch.get_num_threads() == 2
