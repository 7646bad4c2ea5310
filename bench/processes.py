"""The processes an arm of `jobsvc bench` uses, and what the kernel says they spent from a
given moment on: CPU seconds by role, the model runner's wait for a core, and the time the
hypervisor stole. Both arms are read the same way, so their figures compare."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import psutil

from jobsvc.bench.measure import (
    ENGINE_ROLE,
    ProcessKey,
    busy_seconds,
    cpu_seconds_by_role,
    schedstat_wait_ns,
    steal_seconds,
    wait_seconds,
)

# The servers' process names, and their roles in the CPU accounting.
SERVER_ROLES = {"redis-server": "redis", "postgres": "postgres"}
# vLLM names its engine-core and model-runner processes "VLLM::EngineCore", "VLLM::Worker".
ENGINE_PROCESS_PREFIX = "VLLM::"
MODEL_RUNNER_PREFIX = "VLLM::Worker"
# The keys under which a reading carries the hypervisor's steal and the model runner's wait
# for a core, beside the roles' CPU seconds: both are read off like them, since the engine's
# idle threads go on spinning, and waiting, after an arm's last job.
STEAL = "steal"
RUNNER_WAIT = "runner wait"
# And the keys under which it carries the CPU time of the whole machine, and of the other
# programs on it (`foreign_cpu_now`).
MACHINE_CPU = "machine cpu"
FOREIGN_CPU = "foreign cpu"
# The parent of the kernel's own threads on Linux (kthreadd).
_KERNEL_THREADS_PARENT = 2

Member = tuple[psutil.Process, str]


def server_processes() -> dict[str, list[psutil.Process]]:
    """Redis's and PostgreSQL's processes, by role."""
    servers: dict[str, list[psutil.Process]] = {role: [] for role in SERVER_ROLES.values()}
    for process in psutil.process_iter(["name"]):
        role = SERVER_ROLES.get(process.info["name"])
        if role is not None:
            servers[role].append(process)
    return servers


def with_roles(roots: Iterable[psutil.Process], role: str, *, descendants: bool) -> list[Member]:
    """These processes (and their descendants), each with its role: `role`, or ENGINE_ROLE for
    vLLM's engine processes. Finding descendants walks every process on the machine, CPU the
    arm would be charged, so an arm sampled while it runs finds its processes once."""
    tagged: list[Member] = []
    for root in roots:
        try:
            found = [root, *root.children(recursive=True)] if descendants else [root]
        except psutil.NoSuchProcess:
            continue
        for member in found:
            try:
                engine = member.name().startswith(ENGINE_PROCESS_PREFIX)
            except psutil.NoSuchProcess:
                continue
            tagged.append((member, ENGINE_ROLE if engine else role))
    return tagged


class Usage:
    """What an arm's processes have spent since this object was made. The runner threads are
    found once, so that a reading taken while the engine runs reads one file per runner thread
    and no more."""

    def __init__(self, processes: list[Member]) -> None:
        self._processes = processes
        self._runners = _model_runner_threads(processes)
        self._cpu = _cpu_seconds(processes)
        self._waits = _waits(self._runners)
        self._machine = _machine_now()
        self._foreign = foreign_cpu_now()

    def since_start(self) -> dict[str, float]:
        """CPU seconds by role, with the steal under STEAL, the runner wait under RUNNER_WAIT,
        the whole machine's CPU under MACHINE_CPU and other programs' under FOREIGN_CPU (all
        in seconds)."""
        used = cpu_seconds_by_role(self._cpu, _cpu_seconds(self._processes))
        used.update({key: now - self._machine[key] for key, now in _machine_now().items()})
        used[RUNNER_WAIT] = wait_seconds(self._waits, _waits(self._runners))
        used.update(cpu_seconds_by_role(self._foreign, foreign_cpu_now()))
        return used


def foreign_cpu_now() -> dict[ProcessKey, float]:
    """Cumulative CPU seconds of the other programs on the machine, keyed by PID under the
    role FOREIGN_CPU: every process but this one's tree (the bench, the workers it started
    and their engines), Redis's and PostgreSQL's, and the kernel's threads. Each counts the
    children it has reaped, so that a program that started and exited between two readings
    (a monitor's probe, say) shows in its parent; but not this process's ancestors, whose
    reaped children are the bench's own earlier runs. A child's whole life lands at once when
    it is reaped, so a difference of two readings can overstate (ArmResult bounds it)."""
    me = os.getpid()
    processes = list(psutil.process_iter(["name", "ppid", "cpu_times"]))
    parents = {process.pid: process.info["ppid"] for process in processes}
    own, ancestors = _tree(me, parents), _ancestors(me, parents)
    times: dict[ProcessKey, float] = {}
    for process in processes:
        info = process.info
        if (process.pid in own or info["name"] in SERVER_ROLES or info["cpu_times"] is None
                or _KERNEL_THREADS_PARENT in (process.pid, info["ppid"])):
            continue
        cpu = info["cpu_times"]
        reaped = 0.0 if process.pid in ancestors else (getattr(cpu, "children_user", 0.0)
                                                       + getattr(cpu, "children_system", 0.0))
        times[process.pid, FOREIGN_CPU] = cpu.user + cpu.system + reaped
    return times


def _tree(root: int, parents: dict[int, int]) -> set[int]:
    """`root` and its descendants, from one reading of every process's parent (a second walk
    of the process table, as psutil's `children` makes, would cost as much again)."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = {root}, [root]
    while pending:
        for child in children.get(pending.pop(), []):
            tree.add(child)
            pending.append(child)
    return tree


def _ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    """`pid`'s parent, its parent's parent and so on, from the same reading as `_tree`."""
    found: set[int] = set()
    while (pid := parents.get(pid, 0)) and pid not in found:
        found.add(pid)
    return found


def _machine_now() -> dict[str, float]:
    """Seconds the hypervisor has stolen from this machine's cores so far (0 off Linux), and
    seconds its cores have been busy (only on Linux)."""
    try:
        text = Path("/proc/stat").read_text()
    except OSError:
        return {STEAL: 0.0}
    ticks = os.sysconf("SC_CLK_TCK")
    return {STEAL: steal_seconds(text, ticks), MACHINE_CPU: busy_seconds(text, ticks)}


def _cpu_seconds(processes: Iterable[Member]) -> dict[ProcessKey, float]:
    """Cumulative CPU seconds of these processes, keyed by PID and role."""
    times: dict[ProcessKey, float] = {}
    for member, role in processes:
        try:
            cpu = member.cpu_times()
        except psutil.NoSuchProcess:
            continue
        times[member.pid, role] = cpu.user + cpu.system
    return times


def _model_runner_threads(processes: Iterable[Member]) -> list[Path]:
    """The /proc entries of the threads that run the model: in vLLM's model-runner processes
    (or, where the engine core runs the model itself, in the engine's processes) the threads
    named like their process, the main one and OpenMP's. The engine core's other threads spin
    while a step runs, and their wait costs nothing."""
    engines = []
    for member, role in processes:
        if role == ENGINE_ROLE:
            try:
                engines.append((member.pid, member.name()))
            except psutil.NoSuchProcess:
                continue
    runners = [engine for engine in engines if engine[1].startswith(MODEL_RUNNER_PREFIX)]
    found: list[Path] = []
    for pid, name in runners or engines:
        try:
            threads = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for thread in threads:
            try:
                if (thread / "comm").read_text().strip() == name:
                    found.append(thread)
            except OSError:
                continue
    return found


def _waits(threads: Iterable[Path]) -> dict[int, int]:
    """Each thread's cumulative wait for a core (ns), by thread ID; empty where the kernel
    keeps no scheduler statistics."""
    waits: dict[int, int] = {}
    for thread in threads:
        try:
            waits[int(thread.name)] = schedstat_wait_ns((thread / "schedstat").read_text())
        except (OSError, ValueError):
            continue
    return waits
