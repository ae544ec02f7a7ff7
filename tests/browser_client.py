"""Drive the charrun page in headless Chromium (run by the tests inside their own network
namespace, and by scripts/page_screenshots.py). Prints one JSON line at the end.

Two ways to drive it:
- measure (the default): upload an image and speech (or use the fake microphone), start,
  read getStats() and the page's own live numbers `--seconds` apart, screenshot, Stop; with
  `--wait-error`, first print STREAMING and wait for the page to show an error sentence (the
  test kills a rank, or the server, meanwhile).
- `--tour DIR`: everything a first visit meets, as the page shows it: a file that is not an
  image, speech that is not audio, a session (states, the live numbers, the chart, getStats,
  /metrics read at the same moment), screenshots at two widths into DIR, Interrupt, Stop, and
  a proxy's 502 that is not JSON.
Either way the line also lists what the server's Content-Security-Policy refused the page
(`policy_refused`: nothing, where the policy allows all the page does).
"""

import argparse
import json
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
         "--use-fake-device-for-media-stream",
         "--disable-features=WebRtcHideLocalIpsWithMdns"]
WIDE = {"width": 1280, "height": 800}  # a laptop
PHONE = {"width": 390, "height": 844}  # a phone
FIRST_FRAMES = 24  # frames decoded before measuring
VIDEO_TIMEOUT_S = 30
STATE_TIMEOUT_MS = 5000
POLL_S = 0.05

# the page as a person reads it: state, sentence, engine line, every live number, the chart
READ_PAGE = """() => {
  const q = (s) => document.querySelector(s);
  const numbers = {};
  document.querySelectorAll("#live dd").forEach((dd) => {
    numbers[dd.id.slice(2)] = { text: dd.textContent.trim(), ...dd.dataset };
  });
  const engine = {};
  document.querySelectorAll("#engine b").forEach((b) => { engine[b.dataset.field] =
    b.textContent; });
  const chart = q("#chart");
  return { state: q("#state").dataset.state, state_label: q("#state").textContent,
           message: q("#message").textContent, error: q("#message").classList.contains("error"),
           engine, engine_text: q("#engine").textContent, numbers,
           step_label: q("#n-step-label").textContent,
           chart: { points: q("#chart-steps").getAttribute("points"),
                    count: Number(chart.dataset.points || 0),
                    updates: Number(chart.dataset.updates || 0),
                    budget_y: Number(q("#chart-budget").getAttribute("y1")),
                    budget_label: q("#chart-budget-label").textContent },
           start_enabled: !q("#start").disabled, interrupt_enabled: !q("#interrupt").disabled };
}"""


def read_page(page) -> dict:
    return page.evaluate(READ_PAGE)


def wait_until(page, js: str, timeout_ms: int) -> None:
    """Poll until the page's expression `js` holds (page.evaluate: the page's
    Content-Security-Policy refuses the eval that wait_for_function's text predicates use)."""
    end = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(js):
        if time.monotonic() > end:
            raise TimeoutError(f"not within {timeout_ms} ms: {js}")
        time.sleep(POLL_S)


def wait_state(page, states, timeout_ms=STATE_TIMEOUT_MS) -> str:
    wait_until(page, f"{json.dumps(list(states))}.includes("
                     "document.querySelector('#state').dataset.state)", timeout_ms)
    return page.eval_on_selector("#state", "e => e.dataset.state")


def wait_video(page, frames=FIRST_FRAMES) -> dict:
    end = time.monotonic() + VIDEO_TIMEOUT_S
    while True:  # wait_for_function would take the stats' Promise itself as true
        stats = page.evaluate("window.charStats()")
        if stats["video"] and stats["video"]["framesDecoded"] > frames:
            return stats
        if time.monotonic() > end:
            raise TimeoutError(f"no video: {stats} {read_page(page)}")
        time.sleep(0.2)


def wait_error(page, timeout_ms) -> str:
    page.wait_for_selector("#message.error", timeout=timeout_ms)
    return page.inner_text("#message")


def measure(page, args) -> dict:
    if args.image:
        page.set_input_files("#image", args.image)
    if args.speech:
        page.set_input_files("#speech", args.speech)
    if args.mic:
        page.check("#mic")
    page.wait_for_selector("#start:not([disabled])")
    page.click("#start")
    first = wait_video(page)
    out = {"first": first}
    if args.seconds:
        t0 = time.monotonic()
        time.sleep(args.seconds)
        out.update(last=page.evaluate("window.charStats()"), elapsed=time.monotonic() - t0,
                   page=read_page(page))
    page.screenshot(path=args.shot)
    if args.wait_error:
        print("STREAMING", flush=True)
        out["error"] = wait_error(page, args.wait_error * 1000)
        out["after_error"] = read_page(page)
        page.screenshot(path=args.shot)
    else:
        page.click("#stop")
        wait_state(page, ["ended"])
    return out


def tour(page, args) -> dict:
    shots = Path(args.tour)
    shots.mkdir(parents=True, exist_ok=True)
    out = {}
    page.wait_for_selector("#engine b[data-field=family]")
    out["loaded"] = read_page(page)
    page.set_input_files("#image", args.not_image)  # a file that is not an image
    out["not_image"] = wait_error(page, STATE_TIMEOUT_MS)
    out["not_image_page"] = read_page(page)
    page.set_input_files("#image", args.image)
    page.wait_for_selector("#start:not([disabled])")
    out["image_note"] = page.inner_text("#image-note")
    out["image_ready"] = read_page(page)
    page.set_input_files("#speech", args.not_image)  # speech that is not audio: the server's 400
    page.click("#start")
    out["not_audio"] = wait_error(page, VIDEO_TIMEOUT_S * 1000)
    page.set_input_files("#speech", args.speech)
    page.click("#start")
    out["after_start"] = read_page(page)["state"]
    wait_video(page)
    out["streaming_state"] = wait_state(page, ["speaking"])
    page.wait_for_selector("#n-latency[data-value]:not([data-value=''])",
                           timeout=STATE_TIMEOUT_MS)
    first, t0 = page.evaluate("window.charStats()"), time.monotonic()
    out["numbers_1"] = read_page(page)
    time.sleep(args.seconds)
    last, t1 = page.evaluate("window.charStats()"), time.monotonic()
    out["numbers_2"] = read_page(page)
    updates = out["numbers_2"]["chart"]["updates"]
    out["metrics"] = page.evaluate("fetch('/metrics').then((r) => r.text())")
    wait_until(page, f"Number(document.querySelector('#chart').dataset.updates) > {updates + 1}",
               STATE_TIMEOUT_MS)  # a push after the read
    out["numbers_3"] = read_page(page)
    out.update(first=first, last=last, elapsed=t1 - t0)
    page.screenshot(path=str(shots / "serve_wide.png"), full_page=True)
    page.set_viewport_size(PHONE)
    time.sleep(0.3)  # a reflow and a frame at the new width
    page.screenshot(path=str(shots / "serve_phone.png"), full_page=True)
    out["phone_layout"] = page.evaluate("""() => {
      const r = (s) => document.querySelector(s).getBoundingClientRect();
      return { screen: r("#screen"), controls: r(".controls"), numbers: r(".numbers"),
               page_width: document.documentElement.scrollWidth }; }""")
    page.set_viewport_size(WIDE)
    out["wide_layout"] = page.evaluate("""() => {
      const r = (s) => document.querySelector(s).getBoundingClientRect();
      return { screen: r("#screen"), controls: r(".controls"), numbers: r(".numbers"),
               page_width: document.documentElement.scrollWidth }; }""")
    out["before_interrupt"] = read_page(page)["state"]
    page.click("#interrupt")
    out["interrupted"] = wait_state(page, ["interrupted"])
    out["interrupted_page"] = read_page(page)
    page.click("#stop")
    out["stopped"] = wait_state(page, ["ended"])
    out["stopped_page"] = read_page(page)
    page.route("**/offer", lambda route: route.fulfill(  # a proxy in front answers for it
        status=502, content_type="text/html",
        body="<html><head><title>502 Bad Gateway</title></head><body>nginx</body></html>"))
    page.click("#start")
    out["bad_gateway"] = wait_error(page, STATE_TIMEOUT_MS)
    out["bad_gateway_page"] = read_page(page)
    page.unroute("**/offer")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--image")
    ap.add_argument("--speech")
    ap.add_argument("--mic", action="store_true")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--shot", help="measure: where the screenshot goes")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--wait-error", type=float, default=0.0,
                    help="measure: after the first frames, print STREAMING and wait this long "
                         "for the page to show an error sentence")
    ap.add_argument("--tour", metavar="DIR", help="drive the whole page; screenshots into DIR")
    ap.add_argument("--not-image", help="tour: a file that is neither an image nor audio")
    args = ap.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=FLAGS, headless=True)
        page = browser.new_page(viewport=WIDE)
        refused = []  # what the server's Content-Security-Policy kept from the page
        page.on("console", lambda m: refused.append(m.text)
                if "Content Security Policy" in m.text else None)
        page.goto(args.url)
        out = tour(page, args) if args.tour else measure(page, args)
        browser.close()
    print(json.dumps({**out, "policy_refused": refused}))


if __name__ == "__main__":
    main()
