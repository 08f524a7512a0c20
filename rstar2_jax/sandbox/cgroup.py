"""Bounds over all of a call's processes: one cgroup per slot of a template, for memory and CPU.

RLIMIT_AS bounds each process, and the scheduler weighs each process (or, under kernel
autogroup scheduling, each session) alone. A call that forks, calls ``setsid()``, or holds
memory no process maps (memfd files, SysV shared memory, tmpfs pages) needs bounds on the
sum. Each slot of a template gets a cgroup ``rstar2-sandbox-<template pid>-<slot>`` that a
call's child joins before it runs any code, so everything the call does, in any of its
processes and sessions, is charged there:

- memory: limited to ``memory_bytes`` (swap included). When the sum passes the limit the
  kernel kills processes of that cgroup (cgroup v2: all of them, with ``memory.oom.group``);
  the slot's ``oom_kill`` counter tells the template that it happened.
- CPU: at most one CPU (``cpu.max`` / ``cpu.cfs_quota_us`` equal to the period), with the
  default weight of one process (``cpu.weight`` 100 / ``cpu.shares`` 1024). A task in a
  cgroup is outside kernel autogroup scheduling, so a call weighs as one process against the
  trainer and the other calls, however many processes or sessions it makes.

The slot groups are siblings (not children of one group per template): a group's weight does
not grow with the number of its busy children, so nesting would make all the calls of a
template together weigh as one process.

Where each controller is found:

- cgroup v2 (one unified hierarchy): beside this process's cgroup (a cgroup that holds
  processes cannot give its children controllers), or under it when it is the root;
- cgroup v1 (a hierarchy per controller, as on this project's machines): under this
  process's cgroup in that controller's hierarchy.

Creating cgroups needs write access to that part of the hierarchy (root, or a delegated
subtree). Where a controller is unavailable, calls go without that bound: rlimits only for
memory, the scheduler's own fairness for CPU (docs/sandbox.md gives the resulting bounds).
"""
from __future__ import annotations

import dataclasses
import os

_PREFIX = "rstar2-sandbox-"


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, superopts = fields[sep + 1], set(fields[sep + 3].split(","))
            if fstype in ("cgroup", "cgroup2"):
                out.append((fields[3], fields[4], fstype, superopts))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for the v2 hierarchy) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _join(mountpoint: str, mount_root: str, path: str) -> str:
    return os.path.normpath(os.path.join(mountpoint, os.path.relpath(path, mount_root)))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _parent(controller: str) -> tuple[int, str] | None:
    """(cgroup version, directory to create the slot groups in) for ``controller``, or None."""
    own = _own_cgroups()
    for root, point, fstype, _ in _mounts():
        if fstype == "cgroup2" and "" in own:
            here = _join(point, root, own[""])
            try:
                if controller not in _read(os.path.join(here, "cgroup.controllers")).split():
                    continue
            except OSError:
                continue
            return 2, here if own[""] == "/" else os.path.dirname(here)
    for root, point, fstype, superopts in _mounts():
        if fstype == "cgroup" and controller in superopts and controller in own:
            return 1, _join(point, root, own[controller])
    return None


@dataclasses.dataclass
class _Hierarchy:
    """The slot groups of one cgroup hierarchy: which controllers they bound, and where."""

    version: int
    parent_fd: int
    controllers: set[str]
    slot_names: list[str]


def _configure(path: str, version: int, controller: str, memory_bytes: int) -> None:
    if controller == "memory" and version == 2:
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
        _write(os.path.join(path, "memory.oom.group"), "1")
    elif controller == "memory":
        _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
    elif version == 2:  # one CPU: a quota of a whole period in every period
        period = _read(os.path.join(path, "cpu.max")).split()[1]
        _write(os.path.join(path, "cpu.max"), f"{period} {period}")
    else:
        _write(os.path.join(path, "cpu.cfs_quota_us"), _read(os.path.join(path, "cpu.cfs_period_us")).strip())


class SlotCgroups:
    """The cgroups of one template's slots. Created before the template changes its root (the
    cgroup filesystem is not part of a call's view); used through descriptors."""

    def __init__(self, hierarchies: list[_Hierarchy], procs_fds: list[tuple[int, ...]],
                 events_fds: list[int] | None):
        self.hierarchies = hierarchies
        self.procs_fds = procs_fds  # per slot, ``cgroup.procs`` of each hierarchy
        self.events_fds = events_fds  # per slot, the memory controller's OOM counters

    def kind(self, controller: str) -> str | None:
        """``"cgroup v1"`` or ``"cgroup v2"`` where ``controller`` bounds calls, else None."""
        for h in self.hierarchies:
            if controller in h.controllers:
                return f"cgroup v{h.version}"
        return None

    @classmethod
    def create(cls, slots: int, memory_bytes: int) -> "SlotCgroups":
        """The slots' groups for every controller this process may use (possibly none)."""
        wanted: dict[tuple[int, str], set[str]] = {}
        for controller in ("memory", "cpu"):
            found = _parent(controller)
            if found is not None:
                wanted.setdefault(found, set()).add(controller)
        hierarchies, procs, events = [], [[] for _ in range(slots)], None
        for (version, parent), controllers in wanted.items():
            made = _create_slots(version, parent, controllers, slots, memory_bytes)
            if made is None:
                continue
            hierarchy, slot_procs, slot_events = made
            hierarchies.append(hierarchy)
            for s in range(slots):
                procs[s].append(slot_procs[s])
            if slot_events is not None:
                events = slot_events
        return cls(hierarchies, [tuple(p) for p in procs], events)

    def oom_kills(self, slot: int) -> int:
        """How many processes the kernel has killed in this slot's cgroup for lack of memory."""
        if self.events_fds is None:
            return 0
        for line in os.pread(self.events_fds[slot], 4096, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Delete the groups; every process that joined them must be gone."""
        for fd in [fd for fds in self.procs_fds for fd in fds] + (self.events_fds or []):
            os.close(fd)
        for h in self.hierarchies:
            for name in h.slot_names:
                try:
                    os.rmdir(name, dir_fd=h.parent_fd)
                except OSError:
                    pass  # a process is still dying; the next template to start removes it
            os.close(h.parent_fd)


def _create_slots(version: int, parent: str, controllers: set[str], slots: int, memory_bytes: int):
    """The slot groups of one hierarchy: (hierarchy, cgroup.procs fd per slot, OOM counter fd
    per slot or None), or None where this process may not create them."""
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    names = [f"{_PREFIX}{os.getpid()}-{s}" for s in range(slots)]
    opened: list[int] = []
    try:
        _remove_stale(parent_fd)
        if version == 2:  # the slot groups get a controller only where their parent hands it on
            enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
            missing = " ".join(f"+{c}" for c in sorted(controllers) if c not in enabled)
            if missing:
                _write(os.path.join(parent, "cgroup.subtree_control"), missing)
        procs, events = [], [] if "memory" in controllers else None
        for name in names:
            path = os.path.join(parent, name)
            os.mkdir(path)
            for controller in sorted(controllers):
                _configure(path, version, controller, memory_bytes)
            procs.append(os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
            opened.append(procs[-1])
            if events is not None:
                events_file = "memory.events" if version == 2 else "memory.oom_control"
                events.append(os.open(os.path.join(path, events_file), os.O_RDONLY | os.O_CLOEXEC))
                opened.append(events[-1])
    except OSError:
        for fd in opened:
            os.close(fd)
        for name in names:
            try:
                os.rmdir(name, dir_fd=parent_fd)
            except OSError:
                pass
        os.close(parent_fd)
        return None
    return _Hierarchy(version, parent_fd, controllers, names), procs, events


def _remove_stale(parent_fd: int) -> None:
    """Remove groups left by templates that were killed (their pid is gone)."""
    for entry in os.listdir(parent_fd):
        pid = entry[len(_PREFIX):].split("-")[0]
        if not entry.startswith(_PREFIX) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            # Templates before the groups were made per slot nested them: <prefix><pid>/slot<k>.
            group_fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent_fd)
            try:
                for child in os.listdir(group_fd):
                    if child.startswith("slot"):
                        os.rmdir(child, dir_fd=group_fd)
            finally:
                os.close(group_fd)
            os.rmdir(entry, dir_fd=parent_fd)
        except OSError:
            pass
