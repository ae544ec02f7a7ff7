"""Headless Chromium as the other website a user visits while charrun --serve runs (run by the
tests inside their own network namespace, and by scripts/fault_matrix.py): pages of other
origins try what the browser lets any page try against the server, and one page's name is
re-pointed at the server (DNS rebinding). Prints one JSON line: for each attack, what the
server answered each of its requests (as the browser's network saw it, opaque responses
included) and what the page itself could read (or show, of the server's page in a frame).

The attackers' pages are served by the browser's own request routing (no server of theirs
runs): `http://localhost:ATTACKER_PORT/` is a page of another origin on the same machine;
`http://evil.example:PORT/` is a page whose name resolves to the server's address
(--host-resolver-rules), as after a rebinding, so its requests to its "own" origin reach the
server naming evil.example.
"""

import argparse
import json
import time

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import sync_playwright

from browser_client import FLAGS

ATTACKER_PORT = 9666
FRAME_SETTLE_S = 10  # a frame's navigation ends in the page or in the browser's error page
REBOUND = "evil.example"
# checks newer Chromium makes on pages that reach local addresses; off, so that the attacks
# reach the server and the server's own checks are what is tested (a browser without them)
NO_LOCAL_NETWORK_CHECKS = ("--disable-features=PrivateNetworkAccessSendPreflights,"
                           "PrivateNetworkAccessRespectPreflightResults,"
                           "BlockInsecurePrivateNetworkRequests,LocalNetworkAccessChecks,"
                           "PrivateNetworkAccessForWorkers")

# What a page of another origin can send without asking (no preflight): simple requests with
# a text/plain body, with no-cors; a JSON request (which needs a preflight); a form's POST.
CROSS_SITE = """async (base) => {
  const out = {};
  const body = JSON.stringify({ session: "guess", sdp: "v=0", type: "offer" });
  for (const path of ["stop", "interrupt", "offer"]) {
    try {
      const r = await fetch(base + path, { method: "POST", mode: "no-cors", body });
      out[`no-cors POST /${path}`] = `opaque (${r.type})`;
    } catch (e) { out[`no-cors POST /${path}`] = `blocked: ${e.message}`; }
    try {
      const r = await fetch(base + path, { method: "POST", body,
                                           headers: { "Content-Type": "application/json" } });
      out[`JSON POST /${path}`] = `read ${r.status}: ${await r.text()}`;
    } catch (e) { out[`JSON POST /${path}`] = `blocked: ${e.message}`; }
  }
  for (const path of ["status", "metrics"]) {
    try {
      const r = await fetch(base + path);
      out[`GET /${path}`] = `read ${r.status}: ${(await r.text()).slice(0, 80)}`;
    } catch (e) { out[`GET /${path}`] = `blocked: ${e.message}`; }
  }
  return out;
}"""

FORM = """(base) => {
  const f = document.createElement("form");
  f.method = "POST"; f.action = base + "stop"; f.enctype = "text/plain";
  const i = document.createElement("input");
  i.name = '{"session":"guess","x":"'; i.value = '"}';
  f.appendChild(i); document.body.appendChild(f); f.submit();
}"""

# A rebound page's own origin is the server: same-origin requests, readable if the server
# answers them.
REBOUND_PAGE = """async () => {
  const out = {};
  for (const path of ["/status", "/metrics", "/static/page.js", "/readyz"]) {
    try {
      const r = await fetch(path);
      out[`GET ${path}`] = `read ${r.status}: ${(await r.text()).slice(0, 200)}`;
    } catch (e) { out[`GET ${path}`] = `blocked: ${e.message}`; }
  }
  for (const path of ["/stop", "/interrupt"]) {
    try {
      const r = await fetch(path, { method: "POST", body: JSON.stringify({ session: "guess" }),
                                    headers: { "Content-Type": "application/json" } });
      out[`POST ${path}`] = `read ${r.status}: ${await r.text()}`;
    } catch (e) { out[`POST ${path}`] = `blocked: ${e.message}`; }
  }
  return out;
}"""

# The server's page in a frame of another origin's page, which could lay its own buttons over
# Start and Stop (or, with allow="microphone", ask for the microphone through it).
FRAME = """(base) => new Promise((done) => {
  const f = document.createElement("iframe");
  f.src = base; f.allow = "microphone"; f.onload = () => done(null);
  document.body.appendChild(f);
  setTimeout(() => done(null), 5000);
})"""

PAGE = "<!doctype html><title>a page elsewhere</title><body>hello</body>"


def framed(page, url: str) -> str:
    """What another origin's frame of the server's page shows once it has settled: the page
    (its Start button), or the browser's error page (the server forbids framing)."""
    page.evaluate(FRAME, url)
    frame = next(f for f in page.frames if f != page.main_frame)
    end = time.monotonic() + FRAME_SETTLE_S
    while time.monotonic() < end:
        if frame.url.startswith("chrome-error:"):
            return "blocked: the browser shows its error page in the frame"
        try:
            if frame.evaluate("!!document.querySelector('#start')"):
                return f"read: the page, with its Start button, at {frame.url}"
        except PlaywrightError:  # the frame navigating meanwhile
            pass
        time.sleep(0.1)
    return f"neither the page nor the browser's error page within {FRAME_SETTLE_S} s"


def main(args) -> None:
    port = args.url.rstrip("/").rsplit(":", 1)[1]
    attacker = f"http://localhost:{ATTACKER_PORT}/"
    rebound = f"http://{REBOUND}:{port}/"
    health = f"http://{REBOUND}:{args.health}/" if args.health else None
    pages = {attacker, rebound, health} - {None}  # served by the routing, not the server
    result = {"server": {}, "page": {}}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=[
            *FLAGS, NO_LOCAL_NETWORK_CHECKS,
            f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1"])
        page = browser.new_page()

        def seen(response):
            req = response.request
            if req.frame != page.main_frame:
                return  # the framed page's own loads: what it shows is `framed`'s to say
            if req.url not in pages and not req.url.startswith(attacker):
                key = f"{req.method} {req.url}"
                result["server"].setdefault(key, []).append(response.status)

        page.on("response", seen)
        for url in pages:
            page.route(url, lambda r: r.fulfill(body=PAGE, content_type="text/html"))
        page.goto(attacker)
        result["page"]["cross_site"] = page.evaluate(CROSS_SITE, args.url)
        result["page"]["framing"] = {"an iframe of the page": framed(page, args.url)}
        page.evaluate(FORM, args.url)
        page.wait_for_load_state()
        time.sleep(0.5)
        page.goto(rebound)
        result["page"]["rebound"] = page.evaluate(REBOUND_PAGE)
        if health:
            page.goto(health)
            result["page"]["rebound_probes"] = page.evaluate(REBOUND_PAGE)
        browser.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="the server's page, e.g. http://127.0.0.1:8080/")
    ap.add_argument("--health", help="the probe server's port, to try it rebound too")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    main(ap.parse_args())
