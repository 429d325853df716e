"""Processes of a test's server, read from /proc: which one listens on a local TCP port (whose port the API is on),
the processes below a pid, and their threads' niceness."""
from __future__ import annotations

import os
from pathlib import Path


def listener(port: int) -> tuple[int, str]:
    """(pid, command name) of the process listening on 127.0.0.1:`port` (its socket's inode in /proc)."""
    sockets = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # local address, state LISTEN
            sockets.add(f"socket:[{fields[9]}]")  # its inode
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in sockets for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid), Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # a process that ended, or one not ours to read
            continue
    raise AssertionError(f"nothing listens on port {port}")


def _stat_fields(path: str) -> list[str]:
    """A /proc stat line's fields after the command name (which may hold spaces): [state, ppid, ...]."""
    text = Path(path).read_text()
    return text[text.rindex(")") + 2:].split()


def descendants(root: int) -> list[int]:
    """Every live process below `root` (children, their children, ...)."""
    parents: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(pid)] = int(_stat_fields(f"/proc/{pid}/stat")[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier}
        found += sorted(frontier)
    return found


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def thread_niceness(pid: int) -> dict[int, int]:
    """thread id -> niceness for every thread of `pid` (field 19 of each task's stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = int(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[16])
        except (OSError, ValueError, IndexError):
            continue
    return out


def thread_name(pid: int, tid: int) -> str:
    return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()


def may_lower_niceness() -> bool:
    """Whether this process's user may lower a thread's niceness (CAP_SYS_NICE): tried on a thread of its own."""
    import threading

    got: list[bool] = []

    def probe():  # raise this thread's niceness by one (always allowed), then try to undo it
        tid = threading.get_native_id()
        mine = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(mine + 1, 19))
        try:
            os.setpriority(os.PRIO_PROCESS, tid, mine)
            got.append(True)
        except PermissionError:
            got.append(False)
    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got[0]
