"""Drive the charrun page in headless Chromium (run by the tests inside their own network
namespace): upload an image and speech, start, wait, read getStats() twice, screenshot,
optionally interrupt. Prints one JSON line."""

import argparse
import json
import time

from playwright.sync_api import sync_playwright

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required", "--use-fake-ui-for-media-stream",
         "--use-fake-device-for-media-stream",
         "--disable-features=WebRtcHideLocalIpsWithMdns"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--image")
    ap.add_argument("--speech")
    ap.add_argument("--mic", action="store_true")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--shot", required=True)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--wait-error", type=float, default=0.0,
                    help="after the first stats, print STREAMING and wait this long for the "
                         "page to show an error sentence (the test kills a rank meanwhile)")
    args = ap.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=FLAGS, headless=True)
        page = browser.new_page()
        page.goto(args.url)
        if args.image:
            page.set_input_files("#image", args.image)
        if args.speech:
            page.set_input_files("#speech", args.speech)
        if args.mic:
            page.check("#mic")
        page.click("#start")
        end = time.monotonic() + 30
        while True:  # wait_for_function would take the stats' Promise itself as true
            first = page.evaluate("window.charStats()")
            if first["video"] and first["video"]["framesDecoded"] > 24:
                break
            if time.monotonic() > end:
                raise TimeoutError(f"no video: {first}")
            time.sleep(0.2)
        if args.wait_error:
            print("STREAMING", flush=True)
            page.wait_for_selector("#message.error", timeout=args.wait_error * 1000)
            error = page.inner_text("#message")
            page.screenshot(path=args.shot)
            browser.close()
            print(json.dumps({"first": first, "error": error,
                              "start_enabled": True}))
            return
        t0 = time.monotonic()
        time.sleep(args.seconds)
        t1, last = time.monotonic(), page.evaluate("window.charStats()")
        page.screenshot(path=args.shot)
        page.click("#stop")
        browser.close()
    print(json.dumps({"first": first, "last": last, "elapsed": t1 - t0}))


if __name__ == "__main__":
    main()
