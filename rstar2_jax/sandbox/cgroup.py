"""A memory limit over all of a call's processes: one memory cgroup per slot of a template.

RLIMIT_AS bounds each process; a call that forks, or that holds memory no process maps
(memfd files, SysV shared memory, tmpfs pages), needs a limit on the sum. Each slot of a
template gets a cgroup ``rstar2-sandbox-<template pid>/slot<k>`` limited to
``memory_bytes`` (swap included); a call's child joins its slot's cgroup before it runs any
code, so everything the call allocates, in any of its processes, is charged there. When the
sum passes the limit the kernel kills processes of that cgroup (cgroup v2: all of them, with
``memory.oom.group``); the slot's ``oom_kill`` counter tells the template that it happened.

Where the memory controller is found:

- cgroup v2 (one unified hierarchy): a new group beside this process's cgroup (a cgroup that
  holds processes cannot give its children controllers), or under it when it is the root;
- cgroup v1 (a separate ``memory`` hierarchy, as on this project's machines): under this
  process's memory cgroup.

Creating cgroups needs write access to that part of the hierarchy (root, or a delegated
subtree). Where there is none, ``SlotCgroups.create`` returns None and calls are bounded by
their rlimits only (docs/sandbox.md gives the resulting bound).
"""
from __future__ import annotations

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


def _memory_parent() -> tuple[int, str] | None:
    """(cgroup version, directory to create the template's group in), or None."""
    own = _own_cgroups()
    for root, point, fstype, superopts in _mounts():
        if fstype == "cgroup2" and "" in own:
            here = _join(point, root, own[""])
            try:
                with open(os.path.join(here, "cgroup.controllers")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
            return 2, here if own[""] == "/" else os.path.dirname(here)
    for root, point, fstype, superopts in _mounts():
        if fstype == "cgroup" and "memory" in superopts and "memory" in own:
            return 1, _join(point, root, own["memory"])
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _remove_group(parent_fd: int, name: str) -> None:
    """rmdir a template's group and its slots (they must hold no process any more)."""
    try:
        group_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    try:
        for entry in os.listdir(group_fd):
            if entry.startswith("slot"):
                os.rmdir(entry, dir_fd=group_fd)
    finally:
        os.close(group_fd)
    os.rmdir(name, dir_fd=parent_fd)


class SlotCgroups:
    """The memory cgroups of one template's slots. Created before the template changes its
    root (the cgroup filesystem is not part of a call's view); used through descriptors."""

    def __init__(self, version: int, parent_fd: int, name: str, procs_fds: list[int], events_fds: list[int]):
        self.version, self.parent_fd, self.name = version, parent_fd, name
        self.procs_fds, self.events_fds = procs_fds, events_fds

    @property
    def kind(self) -> str:
        return f"cgroup v{self.version}"

    @classmethod
    def create(cls, slots: int, limit_bytes: int) -> "SlotCgroups | None":
        """The slots' cgroups, or None where this process may not create memory cgroups."""
        found = _memory_parent()
        if found is None:
            return None
        version, parent = found
        name = f"{_PREFIX}{os.getpid()}"
        try:
            parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        group = os.path.join(parent, name)
        try:
            _remove_stale(parent_fd)
            os.mkdir(group)
            if version == 2:
                _write(os.path.join(group, "cgroup.subtree_control"), "+memory")
            procs, events = [], []
            for s in range(slots):
                slot = os.path.join(group, f"slot{s}")
                os.mkdir(slot)
                if version == 2:
                    _write(os.path.join(slot, "memory.max"), str(limit_bytes))
                    if os.path.exists(os.path.join(slot, "memory.swap.max")):
                        _write(os.path.join(slot, "memory.swap.max"), "0")
                    _write(os.path.join(slot, "memory.oom.group"), "1")
                    events_file = "memory.events"
                else:
                    _write(os.path.join(slot, "memory.limit_in_bytes"), str(limit_bytes))
                    if os.path.exists(os.path.join(slot, "memory.memsw.limit_in_bytes")):
                        _write(os.path.join(slot, "memory.memsw.limit_in_bytes"), str(limit_bytes))
                    events_file = "memory.oom_control"
                procs.append(os.open(os.path.join(slot, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC))
                events.append(os.open(os.path.join(slot, events_file), os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            try:
                _remove_group(parent_fd, name)
            except OSError:
                pass
            os.close(parent_fd)
            return None
        return cls(version, parent_fd, name, procs, events)

    def oom_kills(self, slot: int) -> int:
        """How many processes the kernel has killed in this slot's cgroup for lack of memory."""
        for line in os.pread(self.events_fds[slot], 4096, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Delete the cgroups; every process that joined them must be gone."""
        for fd in self.procs_fds + self.events_fds:
            os.close(fd)
        try:
            _remove_group(self.parent_fd, self.name)
        except OSError:
            pass  # a process is still dying; the next template to start removes the group
        os.close(self.parent_fd)


def _remove_stale(parent_fd: int) -> None:
    """Remove groups left by templates that were killed (their pid is gone)."""
    for entry in os.listdir(parent_fd):
        if not entry.startswith(_PREFIX) or not entry[len(_PREFIX):].isdigit():
            continue
        try:
            os.kill(int(entry[len(_PREFIX):]), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            _remove_group(parent_fd, entry)
        except OSError:
            pass
