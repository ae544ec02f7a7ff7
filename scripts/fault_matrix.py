"""Fault matrix: run charbuild and charrun against the table of faults (fault_cases.py, with
its fixtures in fault_fixtures.py) and write what happened.

Each case runs the real command (charbuild, charrun render, charrun --serve) as a subprocess
against engines built fresh for the run, and records its exit code, the line it printed, any
Python traceback, whether its output file plays (decoded with PyAV) and holds the frames the
command claims, whether files a user had set up are intact, its wall time and the peak
memory of its process tree. The results replace the table between the markers
<!-- fault-matrix --> and <!-- /fault-matrix --> in docs/RELIABILITY.md (the file is created
if it is missing), and go to a JSON file with --json.

Everything the script makes (engines, media, outputs, a user's pretend files) lives in one
temporary directory, removed at the end; nothing else is touched.

    .venv/bin/python scripts/fault_matrix.py                     # all cases, about 4 minutes
    .venv/bin/python scripts/fault_matrix.py --json results.json
    .venv/bin/python scripts/fault_matrix.py --only 'render-sig' --no-doc   # a few cases
"""


from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from netns import can_netns, namespace  # noqa: E402 - the tests' namespaces, shared
from fault_cases import Case, all_cases  # noqa: E402
from fault_fixtures import (GRACE_S, NETNS, NETNS_SUBNET, REPO, alive, decode, free_port,  # noqa: E402
    in_netns, kill_all, make_shared, Running, supervise)


DOC = REPO / "docs" / "RELIABILITY.md"
BEGIN, END = "<!-- fault-matrix -->", "<!-- /fault-matrix -->"
REGENERATE = ".venv/bin/python scripts/fault_matrix.py"
LEFTOVER_GLOBS = ("*.building-*", "*.partial", "*.replaced-*", "*.writing-*", ".*.lock")
BOX_CHARS = set("━─│┃┏┓┗┛┡┩└┘┌┐╇╈┳┻╋├┤┼╭╮╰╯")
LINE_WIDTH = 160
LOG_STAMP = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ ")  # logging's asctime
HOSTILE_BEGIN, HOSTILE_END = "<!-- hostile-page -->", "<!-- /hostile-page -->"


# ---------------------------------------------------------------------------------------
# cases as data


def reap_leftovers(procs: list[psutil.Process]) -> int:
    """Processes of the case still running GRACE_S after its main process ended: killed,
    and counted."""
    deadline = time.monotonic() + GRACE_S
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in procs if alive(p)]
    kill_all(left)
    return len(left)


# ---------------------------------------------------------------------------------------
# things a case does while its command runs


def snapshot(root: Path, rels: tuple[str, ...]) -> dict[str, str]:
    """sha256 of every file under the guarded paths (paths relative to root)."""
    out = {}
    for rel in rels:
        base = root / rel
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in files:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def lost_files(root: Path, before: dict[str, str]) -> list[str]:
    lost = []
    for rel, digest in before.items():
        p = root / rel
        if not p.is_file():
            lost.append(f"{rel} removed")
        elif hashlib.sha256(p.read_bytes()).hexdigest() != digest:
            lost.append(f"{rel} changed")
    return lost


def leftovers(root: Path, case: Case) -> list[str]:
    found = [f"{rel} exists" for rel in case.absent if (root / rel).exists()]
    for rel in case.leftovers:
        d = root / rel
        for pattern in LEFTOVER_GLOBS:
            found += [f"{p.relative_to(root)} left" for p in d.glob(pattern)] if d.is_dir() else []
    return found


def meaningful(line: str) -> bool:
    """A line a person would read as the command's message (rich's table, bar and title
    lines are not)."""
    s = line.strip()
    if not s or BOX_CHARS & set(s) or s.startswith("generating"):
        return False
    return not re.match(r"(\d+ steps, \d+ frames in|generated; real time is)", s)


def printed_line(stdout: str, stderr: str, pattern: str | None) -> str:
    lines = [LOG_STAMP.sub("", l) for l in stderr.splitlines()]
    if pattern:
        hits = [l for l in lines + stdout.splitlines() if re.search(pattern, l.strip())]
        if hits:
            return hits[-1].strip()
    kept = [l.strip() for l in lines if meaningful(l)]
    return kept[-1] if kept else ""


def frame_claim(text: str) -> int | None:
    hits = re.findall(r"holds (\d+) frames|wrote \S+: (\d+) frames", text)
    if not hits:
        return None
    a, b = hits[-1]
    return int(a or b)


# ---------------------------------------------------------------------------------------
# one case


def short_command(argv: list[str]) -> str:
    """The command as the table shows it: {port} as P and {health} as H (they change every
    run)."""
    return " ".join(shlex.quote(a.replace("{port}", "P").replace("{health}", "H"))
                    for a in argv)


def fill(argv: list[str], ctx: dict) -> list[str]:
    return [a.format(**ctx) if "{" in a else a for a in argv]


def execute(case: Case, root: Path, tools: dict[str, str], ctx: dict) -> dict:
    """Set up, run and supervise the command; what the row needs from the run."""
    if case.setup:
        case.setup(root, ctx)
    before = snapshot(root, case.guard)
    argv = fill(case.argv, ctx)
    running = Running([*case.wrap, *(tools.get(a, a) for a in argv)], root / case.cwd,
                      case.fsize)
    helper = None
    if case.during:
        helper = threading.Thread(target=guarded, args=(case.during, running, ctx), daemon=True)
        helper.start()
    try:
        result = supervise(running, case.timeout)
    finally:
        if running.proc.poll() is None:
            kill_all([*running.descendants(), running.ps])
    if helper:
        helper.join(15)
    result["left_running"] = reap_leftovers(result.pop("seen"))
    running.close_streams()
    ctx["stdout"], ctx["stderr"] = running.text("stdout"), running.text("stderr")
    result["lost"] = lost_files(root, before)
    result["leftovers"] = leftovers(root, case)
    return result


def guarded(fn, running: Running, ctx: dict) -> None:
    try:
        fn(running, ctx)
    except Exception as e:  # noqa: BLE001 - a helper's failure is the row's, not the run's
        ctx["notes"].append(f"case error: {type(e).__name__}: {e}")


def output_cell(case: Case, row: dict, ctx: dict) -> str:
    parts = []
    d = ctx.get("decoded")
    if d is not None:
        if d["state"] == "plays":
            parts.append(f"plays ({d['frames']} frames)")
        else:
            parts.append(d["state"] + (f" ({d['why']})" if d.get("why") else ""))
        claim = row["claim"]
        if claim is not None and d["state"] == "plays":
            parts.append(f"claim {claim} {'matches' if claim == d['frames'] else 'DOES NOT match'}")
    parts += ctx["notes"]
    return "; ".join(parts) or "—"


def lost_cell(case: Case, row: dict) -> str:
    if not (case.guard or case.absent or case.leftovers):
        return "—"
    problems = row["lost_list"] + row["leftovers"]
    return "nothing lost" if not problems else "; ".join(problems)


def judge(case: Case, row: dict, facts: dict) -> list[str]:
    e, problems = case.expect, []
    rc = row["exit"]
    if e.rc == "nonzero" and rc in (0, None):
        problems.append(f"exit {rc}, expected non-zero")
    elif isinstance(e.rc, tuple) and rc not in e.rc:
        problems.append(f"exit {rc}, expected one of {e.rc}")
    elif isinstance(e.rc, int) and rc != e.rc:
        problems.append(f"exit {rc}, expected {e.rc}")
    if e.plays is True and row["plays"] is not True:
        problems.append("the output does not play")
    if e.plays is False and case.out and row["decoded_state"] != "no file":
        problems.append(f"an output was written ({row['decoded_state']})")
    if e.line and not re.search(e.line, row["line"]):
        problems.append(f"line does not match /{e.line}/")
    if e.claim and row["plays"] and row["claim"] != row["frames"]:
        problems.append(f"claims {row['claim']} frames, decoded {row['frames']}")
    if e.max_s is not None and row["wall_s"] > e.max_s:
        problems.append(f"took {row['wall_s']:.1f} s (limit {e.max_s} s)")
    if e.max_mb is not None and row["peak_mb"] > e.max_mb:
        problems.append(f"peak {row['peak_mb']:.0f} MB (limit {e.max_mb} MB)")
    if e.facts:
        problems += e.facts(facts)
    if row["traceback"]:
        problems.append("traceback printed")
    if row["lost_list"] or row["leftovers"]:
        problems.append("lost or left: " + "; ".join(row["lost_list"] + row["leftovers"]))
    if row["left_running"]:
        problems.append(f"{row['left_running']} processes still running {GRACE_S:g} s after "
                        "exit (killed)")
    if row["timed_out"]:
        problems.append("timed out")
    problems += [n for n in row["notes"] if n.startswith("case error")]
    return problems


def run_case(case: Case, root: Path, tools: dict[str, str]) -> dict:
    ctx = {"root": root, "tools": tools, "notes": [], "facts": {}, "close": [], "port": 0,
           "command": short_command(case.argv), "stdout": "", "stderr": ""}
    try:
        result = execute(case, root, tools, ctx)
    except Exception as e:  # noqa: BLE001 - one case's failure must not end the run
        ctx["notes"].append(f"case error: {type(e).__name__}: {e}")
        result = {"rc": None, "wall_s": 0.0, "peak_mb": 0.0, "timed_out": False,
                  "left_running": 0, "lost": [], "leftovers": []}
    finally:
        for c in ctx["close"]:
            c.close()
    return make_row(case, root, ctx, result)


def make_row(case: Case, root: Path, ctx: dict, result: dict) -> dict:
    both = ctx["stdout"] + "\n" + ctx["stderr"]
    if case.out and result["rc"] is not None:
        ctx["decoded"] = decode(root / case.out if not case.out.startswith("/")
                                else Path(case.out))
    if case.post and result["rc"] is not None:
        guarded(lambda _, c: case.post(root, c), None, ctx)
    d = ctx.get("decoded", {})
    row = {"case": case.name, "group": case.group, "command": ctx["command"],
           "exit": result["rc"], "wall_s": round(result["wall_s"], 2),
           "line": printed_line(ctx["stdout"], ctx["stderr"], case.line)[:LINE_WIDTH],
           "traceback": "Traceback" in both, "decoded_state": d.get("state"),
           "plays": d.get("state") == "plays" if d else None, "frames": d.get("frames"),
           "audio_s": d.get("audio_s"), "claim": frame_claim(both),
           "peak_mb": round(result["peak_mb"], 1), "timed_out": result["timed_out"],
           "left_running": result["left_running"], "lost_list": result["lost"],
           "leftovers": result["leftovers"], "notes": list(ctx["notes"]),
           "facts": dict(ctx["facts"]), "should_play": case.expect.plays is True,
           "stderr_tail": ctx["stderr"].splitlines()[-25:],
           "stdout_tail": ctx["stdout"].splitlines()[-5:]}
    row["output"] = output_cell(case, row, ctx)
    row["lost"] = lost_cell(case, row)
    row["problems"] = judge(case, row, ctx["facts"])
    return row


# ---------------------------------------------------------------------------------------
# the table and the document


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def exit_text(rc: int | None) -> str:
    if rc is None:
        return "not run"
    if rc < 0:
        return f"{rc} = {signal.Signals(-rc).name}"
    return str(rc)


def table(rows: list[dict]) -> str:
    head = ("| case | command | exit | line printed | traceback | output | lost | peak MB |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        exit_ = "killed (timeout)" if r["timed_out"] else exit_text(r["exit"])
        lines.append("| " + " | ".join([
            cell(r["case"]), f"`{cell(r['command'])}`", f"{cell(exit_)} ({r['wall_s']:.1f} s)",
            cell(r["line"]) or "—", "**yes**" if r["traceback"] else "no", cell(r["output"]),
            cell(r["lost"]), f"{r['peak_mb']:.0f}"]) + " |")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    tb = sum(r["traceback"] for r in rows)
    lost = sum(bool(r["lost_list"] or r["leftovers"]) for r in rows)
    silent = sum(r["should_play"] and not r["plays"] for r in rows)
    odd = sum(bool(r["problems"]) for r in rows)
    return (f"{len(rows)} cases: {tb} with a traceback, {lost} that lost or left something, "
            f"{silent} outputs that should play and do not; {odd} differ from what was "
            "expected.")


def section(rows: list[dict], seconds: float) -> str:
    return (f"{BEGIN}\n_Generated by `{REGENERATE}` in {seconds:.0f} s; exit shows the code "
            "and the wall time._\n\n" + table(rows) + "\n\n" + summary(rows) + f"\n{END}")


INTRO = f"""# Reliability

The goal: whatever a user gives charbuild or charrun (a wrong path, a damaged file, odd
media, a full disk, a signal at any moment), and whatever reaches `--serve` (a careless
client, a page elsewhere in the user's browser), the tools answer with one line and no
traceback, nothing the user had is lost, no temporary file outlives the next run, and every
output that should play plays and holds what the command says it holds. Regenerate both
tables below with

```
{REGENERATE}
```

## The fault matrix

Each row runs the real command against freshly built tiny engines on the CPU: charbuild's
and charrun's command-line faults (a file-size limit stands in for a full disk: the same
EFBIG a write meets; `setpriv` drops root's right to read others' files, as the container's
user lacks it), and `--serve` met by one request each: a host name it does not answer to
(DNS rebinding), a POST from another origin, a body that is not JSON, malformed fields,
speech that would decode to gigabytes, uploads past the in-flight caps, control requests
naming no session or another's, a TP rank killed while idle, and a WebRTC client killed
mid-session (inside a network namespace of the run's own, where root can make one). What
the server checks and why: `docs/DEPLOY.md` ("Who may use the server").

"""


def write_doc(path: Path, rows: list[dict], seconds: float, hostile: str | None) -> None:
    text = path.read_text() if path.exists() else INTRO
    text = replace_block(text, BEGIN, END, section(rows, seconds))
    if hostile is not None:
        text = replace_block(text, HOSTILE_BEGIN, HOSTILE_END, hostile)
    path.write_text(text)


def replace_block(text: str, begin: str, end: str, block: str) -> str:
    """`text` with the part between the markers replaced by `block` (which holds them), or
    `block` added at its end."""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


# ---------------------------------------------------------------------------------------
# pages of other origins against a live session, in real Chromium


def hostile_pages(root: Path, tools: dict[str, str]) -> tuple[dict, dict] | None:
    """A session streaming to a WebRTC client while Chromium opens pages of other origins
    and a rebound page (tests/hostile_page.py), inside the run's namespace: (what the
    attackers saw, the server's /status after); None where Chromium or playwright is
    missing."""
    chromium = shutil.which("chromium")
    try:
        import playwright  # noqa: F401
    except ImportError:
        return None
    if chromium is None:
        return None
    port, health = free_port(), free_port()
    url = f"http://127.0.0.1:{port}/"
    server = Running(in_netns(tools["charrun"], "--engine", "cpu-tiny", "--serve", "--port",
                              str(port), "--health-port", str(health)), root)
    try:
        if not server.wait_for("serving on", "stdout", timeout=60):
            raise RuntimeError("the server did not start: " + server.text("stderr")[-300:])
        victim = subprocess.Popen(in_netns(sys.executable, str(REPO / "tests/webrtc_client.py"),
                                           "--url", url, "--seconds", "120"),
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for ln in iter(victim.stdout.readline, ""):
                if json.loads(ln)["kind"] == "streaming":
                    break
            r = subprocess.run(in_netns(sys.executable, str(REPO / "tests/hostile_page.py"),
                                        "--url", url, "--health", str(health), "--chromium",
                                        chromium), capture_output=True, text=True, timeout=180)
            attacks = json.loads(r.stdout.strip().splitlines()[-1])
            status = json.loads(subprocess.run(in_netns(sys.executable, "-c",
                "import urllib.request, sys; print(urllib.request.urlopen(sys.argv[1])"
                ".read().decode())", url + "status"), capture_output=True, text=True).stdout)
            status["victim_connected"] = victim.poll() is None
        finally:
            victim.kill()
            victim.wait(10)
        return attacks, status
    finally:
        server.signal(signal.SIGTERM)
        server.proc.wait(30)
        server.close_streams()


def hostile_section(found: tuple[dict, dict] | None) -> str:
    if found is None:
        return (f"{HOSTILE_BEGIN}\n_Not run here: needs root (a network namespace), Debian's "
                f"chromium and playwright._\n{HOSTILE_END}")
    attacks, status = found
    lines = ["| page | what it tried | what the page could read |", "|---|---|---|"]
    names = {"cross_site": "another origin (localhost:9666)",
             "framing": "another origin (localhost:9666) framing the page",
             "rebound": "evil.example re-pointed at the server's page port",
             "rebound_probes": "evil.example re-pointed at the probe port"}
    for key, label in names.items():
        for what, got in attacks["page"].get(key, {}).items():
            lines.append(f"| {label} | {cell(what)} | {cell(got[:150])} |")
    answers = ["| request that reached the server | its answers |", "|---|---|"]
    for request, codes in sorted(attacks["server"].items()):
        answers.append(f"| `{cell(request)}` | {', '.join(map(str, codes))} |")
    ok = all(c in (403, 405, 415) for codes in attacks["server"].values() for c in codes)
    verdict = (f"The victim's session after: /status reads {status['state']!r}, "
               f"{status['sessions']} session(s) started, its client "
               f"{'still connected' if status['victim_connected'] else 'DISCONNECTED'}; "
               + ("every request that reached the server was refused."
                  if ok else "SOME REQUEST WAS ANSWERED."))
    return (f"{HOSTILE_BEGIN}\n_Generated by `{REGENERATE}` (tests/hostile_page.py in headless "
            "Chromium, with the browser's own local-network checks off, so that the server's "
            "checks are what is shown)._\n\n" + "\n".join(lines) + "\n\n" +
            "\n".join(answers) + "\n\n" + verdict + f"\n{HOSTILE_END}")


# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def namespace_of_the_run():
    """The run's network namespace (NETNS), for the cases with a WebRTC peer."""
    with namespace(NETNS.rstrip("0123456789"), NETNS_SUBNET) as name:
        assert name == NETNS, (name, NETNS)
        yield name


def find_tools() -> dict[str, str]:
    tools = {}
    for name in ("charbuild", "charrun"):
        here = Path(sys.executable).parent / name
        found = str(here) if here.exists() else shutil.which(name)
        if not found:
            raise SystemExit(f"fault_matrix: {name} not found beside {sys.executable} or on PATH")
        tools[name] = found
    return tools


def progress(i: int, n: int, row: dict) -> None:
    verdict = "ok" if not row["problems"] else "UNEXPECTED: " + "; ".join(row["problems"])
    print(f"[{i:2d}/{n}] {row['case']:<36} exit {row['exit']!s:>4} {row['wall_s']:5.1f} s "
          f"{row['peak_mb']:6.0f} MB  {verdict}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", type=Path, default=DOC,
                   help="Markdown file whose fault-matrix section is replaced "
                        "(default: %(default)s)")
    p.add_argument("--no-doc", action="store_true", help="write no Markdown")
    p.add_argument("--json", type=Path, help="also write the raw results as JSON here")
    p.add_argument("--only", help="run only the cases whose name matches this regex (the "
                                  "document is then not written)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [c for c in all_cases() if not args.only or re.search(args.only, c.name)]
    if args.list:
        print("\n".join(f"{c.group:<9} {c.name}" for c in cases))
        return 0
    tools = find_tools()
    t0 = time.monotonic()
    rows, hostile = [], None
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp, \
            (namespace_of_the_run() if can_netns() else contextlib.nullcontext()):
        root = Path(tmp)
        print(f"fault_matrix: media and engines in {root} ...", file=sys.stderr, flush=True)
        make_shared(root, tools)
        for i, case in enumerate(cases, 1):
            rows.append(run_case(case, root, tools))
            progress(i, len(cases), rows[-1])
        if not args.only and can_netns():
            print("fault_matrix: pages of other origins against a live session ...",
                  file=sys.stderr, flush=True)
            hostile = hostile_section(hostile_pages(root, tools))
    seconds = time.monotonic() - t0
    print(f"fault_matrix: {summary(rows)} ({seconds:.0f} s)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"seconds": round(seconds, 1), "rows": rows}, indent=2))
    if args.only and not args.no_doc:
        print("fault_matrix: --only: the document is left as it is", file=sys.stderr)
    elif not args.no_doc:
        write_doc(args.doc, rows, seconds, hostile)
        print(f"fault_matrix: wrote {args.doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
