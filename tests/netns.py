"""A network namespace of a test's own for WebRTC peers: loopback up and a veth pair with
both ends inside it (aioice gathers no loopback candidates; inside the namespace the only
other addresses are the pair's, so no traffic leaves it), and charrun --serve run inside
one. Needs root and iproute2."""

import contextlib
import os
import shutil
import subprocess
import sys
import time


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


def in_ns(ns, *cmd):
    """A command run inside namespace `ns`."""
    return ["ip", "netns", "exec", ns, *cmd]


def wait_http(ns, url, timeout=60):
    """Until `url` answers from inside `ns` (TimeoutError past `timeout` s)."""
    end = time.time() + timeout
    while time.time() < end:
        r = subprocess.run(in_ns(ns, sys.executable, "-c",
                                 f"import urllib.request; urllib.request.urlopen('{url}')"),
                           capture_output=True)
        if r.returncode == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(url)


def serve_in(ns, engine, port, *flags):
    """`charrun --engine engine --serve --port port *flags` inside `ns`, once its page
    answers: (the process, its output piped; the page's URL)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(in_ns(ns, sys.executable, "-m", "charengine.runtime.cli",
                                    "--engine", str(engine), "--serve", "--port", str(port),
                                    *flags),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}/"
    try:
        wait_http(ns, url)
    except TimeoutError:
        server.kill()
        raise
    return server, url


def end_server(server) -> str:
    """SIGTERM (SIGKILL past 20 s) a server serve_in started; everything it printed."""
    server.terminate()
    try:
        out, _ = server.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
        out, _ = server.communicate()
    return out
