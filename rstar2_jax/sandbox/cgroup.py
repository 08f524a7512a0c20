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

Memory is also bounded per template: in the hierarchy of the memory controller the slot groups
are children of a template group ``rstar2-sandbox-<template pid>`` limited to the template's
share of the pool's bound (``pool_memory_bytes / num_workers``), so all the calls of a pool
together never hold more than ``pool_memory_bytes``; past a template's share the kernel kills a
process of one of its calls (the largest), whose slot counts the kill. Every call process also
gets ``oom_score_adj`` 1000 (``runner``): under the host's own memory pressure the kernel kills
calls before the trainer.

In a hierarchy of the CPU controller alone (cgroup v1) the slot groups are siblings, not
children of one group per template: a group's weight does not grow with the number of its busy
children, so nesting would make all the calls of a template together weigh as one process.
Where the two controllers share a hierarchy (cgroup v2), the template group weighs as many
processes as it has slots, so that its calls, all busy, weigh as they would as siblings.

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
    """The slot groups of one cgroup hierarchy: which controllers they bound, and where (paths
    relative to ``parent_fd``; ``template`` is the group that holds them, or None)."""

    version: int
    parent_fd: int
    controllers: set[str]
    slot_names: list[str]
    template: str | None


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


def _configure_template(path: str, version: int, controllers: set[str], memory_bytes: int, slots: int) -> None:
    """The template group: its calls' memory together, and the weight of ``slots`` processes."""
    if version == 2:
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
        if "cpu" in controllers:
            _write(os.path.join(path, "cpu.weight"), str(min(10000, 100 * slots)))
        _write(os.path.join(path, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(controllers)))
        return
    try:  # always on since Linux 5.11; before, the limit holds for children only with it
        _write(os.path.join(path, "memory.use_hierarchy"), "1")
    except OSError:
        pass
    _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
    if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
        _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
    if "cpu" in controllers:
        _write(os.path.join(path, "cpu.shares"), str(1024 * slots))


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
    def create(cls, slots: int, memory_bytes: int, template_memory_bytes: int) -> "SlotCgroups":
        """The slots' groups for every controller this process may use (possibly none): each
        slot's memory limited to ``memory_bytes``, all of them together to
        ``template_memory_bytes``."""
        wanted: dict[tuple[int, str], set[str]] = {}
        for controller in ("memory", "cpu"):
            found = _parent(controller)
            if found is not None:
                wanted.setdefault(found, set()).add(controller)
        hierarchies, procs, events = [], [[] for _ in range(slots)], None
        for (version, parent), controllers in wanted.items():
            made = _create_slots(version, parent, controllers, slots, memory_bytes, template_memory_bytes)
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
            _remove_groups(h.parent_fd, h.slot_names + ([h.template] if h.template else []))
            os.close(h.parent_fd)


def _remove_groups(parent_fd: int, names: list[str]) -> None:
    for name in names:
        try:
            os.rmdir(name, dir_fd=parent_fd)
        except OSError:
            pass  # a process is still dying; the next template to start removes it


def _create_slots(version: int, parent: str, controllers: set[str], slots: int, memory_bytes: int,
                  template_memory_bytes: int):
    """The slot groups of one hierarchy: (hierarchy, cgroup.procs fd per slot, OOM counter fd
    per slot or None), or None where this process may not create them."""
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    template = f"{_PREFIX}{os.getpid()}" if "memory" in controllers else None
    if template is not None:
        names = [f"{template}/slot{s}" for s in range(slots)]
    else:
        names = [f"{_PREFIX}{os.getpid()}-{s}" for s in range(slots)]
    opened: list[int] = []
    try:
        _remove_stale(parent_fd)
        if version == 2:  # the slot groups get a controller only where their parent hands it on
            enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
            missing = " ".join(f"+{c}" for c in sorted(controllers) if c not in enabled)
            if missing:
                _write(os.path.join(parent, "cgroup.subtree_control"), missing)
        if template is not None:
            os.mkdir(os.path.join(parent, template))
            _configure_template(os.path.join(parent, template), version, controllers, template_memory_bytes, slots)
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
        _remove_groups(parent_fd, names + ([template] if template else []))
        os.close(parent_fd)
        return None
    return _Hierarchy(version, parent_fd, controllers, names, template), procs, events


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
            # Memory slot groups are nested in their template's group: <prefix><pid>/slot<k>.
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
