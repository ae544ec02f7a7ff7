"""A network namespace of a test's own for WebRTC peers: loopback up and a veth pair with
both ends inside it (aioice gathers no loopback candidates; inside the namespace the only
other addresses are the pair's, so no traffic leaves it). Needs root and iproute2."""

import contextlib
import os
import shutil
import subprocess


def can_netns() -> bool:
    """Whether this process can make a network namespace."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"charprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@contextlib.contextmanager
def namespace(prefix: str, subnet: str):
    """A namespace named prefix + pid, its veth ends at subnet.1 and subnet.2 (/24); yields
    its name and deletes it after."""
    name = f"{prefix}{os.getpid()}"
    run = lambda *a: subprocess.run(["ip", *a], check=True, capture_output=True)  # noqa: E731
    run("netns", "add", name)
    try:
        run("-n", name, "link", "set", "lo", "up")
        run("-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        for dev, host in (("v0", 1), ("v1", 2)):
            run("-n", name, "addr", "add", f"{subnet}.{host}/24", "dev", dev)
            run("-n", name, "link", "set", dev, "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
