"""Which process listens on a local TCP port (the HTTP front tests ask whose port the API is on)."""
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
