"""Two trees' step times measured interleaved in one call: the same measurements run from a
base commit's tree (exported with `git archive` into a temporary directory, imported from
there) and from this checkout, alternating run by run (the order of the two flipped each
run), each run a fresh process; per measurement the median of each tree and their ratio.
It is how a change that should move no time is shown to move none on the same machine
within one sitting.

    python scripts/compare_trees.py --base 8a2843f --runs 3 \\
        --out docs/results/compare_8a2843f_h200.json                     # one H200
    python scripts/compare_trees.py --base 8a2843f --runs 2 --set cpu   # the script's own check

Where this checkout has no git history, --base takes a directory holding the base tree,
exported where the history is (`mkdir DIR && git archive 8a2843f | tar -x -C DIR`); the
results then name the directory as the base.

The measurements (`SETS`): on a GPU the characters-57b TP-3 rank-0 slice's production step
(scripts/bench_session.py, in memory) and livetalk-1.3b's production chunk through an engine
each tree builds (charbuild --target h200-livetalk --random-weights, then
scripts/long_session.py --engine); on a CPU the tiny presets the same way. A tree
whose packages sit in top-level folders (builder/, runtime/, plugins/ mapped into
charengine by its pyproject) is imported through links to them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from charengine.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("builder", "runtime", "plugins")  # charengine's subpackages a tree may keep apart
NOT_TREE = (".git", ".venv", "__pycache__", "engines")  # left out of a --base directory's copy

# name -> (engine target to build per tree or None, the command, the JSON key of its figure)
SETS = {
    "gpu": {
        "characters-57b TP-3 rank-0 step, production (ms)": (
            None, ["scripts/bench_session.py", "--preset", "characters-57b", "--tp", "3",
                   "--rank", "0", "--arm", "production", "--steps", "120", "--exclude", "45",
                   "--profile-steps", "0", "--profile-graph-steps", "0", "--out", "{dir}"],
            "diffusion_p50_ms"),
        "livetalk-1.3b chunk through the engine (ms)": (
            "h200-livetalk", ["scripts/long_session.py", "--engine", "{engine}",
                              "--steps", "48", "--out", "{dir}/run.json"],
            "diffusion_p50_ms"),
    },
    "cpu": {
        "tiny step, production, CPU (ms)": (
            None, ["scripts/bench_session.py", "--preset", "tiny", "--tp", "1", "--device",
                   "cpu", "--arm", "production", "--steps", "30", "--exclude", "10",
                   "--profile-steps", "0", "--profile-graph-steps", "0", "--gpu-tag", "cpu",
                   "--out", "{dir}"],
            "diffusion_p50_ms"),
        "tiny-livetalk chunk through the engine, CPU (ms)": (
            "cpu-tiny-livetalk", ["scripts/long_session.py", "--engine", "{engine}",
                                  "--steps", "8", "--out", "{dir}/run.json"],
            "diffusion_p50_ms"),
    },
}


def export_tree(rev: str, into: Path) -> Path:
    """`rev`'s files (a commit, or a directory holding its exported tree) under into/tree,
    and into/site: an import path where charengine holds its subpackages wherever the tree
    keeps them."""
    tree, site = into / "tree", into / "site"
    if Path(rev).is_dir():
        shutil.copytree(rev, tree, symlinks=True, ignore=shutil.ignore_patterns(*NOT_TREE))
    else:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
        if archive.returncode != 0:
            why = (archive.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
            raise SystemExit(f"compare_trees: cannot export {rev} from this checkout ({why}); "
                             f"export it where its history is (mkdir DIR && git archive {rev} "
                             "| tar -x -C DIR) and give --base DIR")
        tree.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    if not (tree / "charengine").is_dir():
        raise SystemExit(f"compare_trees: {rev} holds no charengine/: not a tree of this "
                         "project")
    site.mkdir()
    (site / "charengine").mkdir()
    for entry in (tree / "charengine").iterdir():
        (site / "charengine" / entry.name).symlink_to(entry)
    for name in PACKAGES:
        if not (site / "charengine" / name).exists() and (tree / name).is_dir():
            (site / "charengine" / name).symlink_to(tree / name)
    return tree


def env_for(site: Path) -> dict:
    """The tree's import path first (the commands also run in `site`, so that neither the
    working directory nor this checkout's editable install gives another charengine)."""
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1"}


def build(tree: Path, site: Path, target: str, out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "charengine.builder.cli", "--target", target,
                    "--random-weights", "--out", str(out)], check=True, cwd=site,
                   env=env_for(site), capture_output=True)
    return out


# a script a tree from before the benchmark pairs became one script each runs under an
# earlier name (found there: the tree is that old): its name and flags there
EARLIER = {"scripts/long_session.py": ("scripts/livetalk_long_session.py",
                                        {"--steps": "--chunks"})}


def run_once(tree: Path, site: Path, cmd: list[str], engine: Path | None, key: str,
             scratch: Path) -> float:
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    argv = [a.format(dir=scratch, engine=engine or "") for a in cmd]
    if argv[0] in EARLIER and (tree / EARLIER[argv[0]][0]).exists():
        name, flags = EARLIER[argv[0]]
        argv = [name, *(flags.get(a, a) for a in argv[1:])]
    r = subprocess.run([sys.executable, str(tree / argv[0]), *argv[1:]], cwd=site,
                       env=env_for(site), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(argv)} in {tree}: exit {r.returncode}\n{r.stderr[-2000:]}")
    found = sorted(scratch.glob("*.json"))
    if len(found) != 1:
        raise SystemExit(f"{' '.join(argv)}: expected one result file, found {found}")
    return float(json.loads(found[0].read_text())[key])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True,
                    help="the commit to compare this checkout with, or a directory holding "
                         "its exported tree")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--set", choices=sorted(SETS), default="gpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    made = provenance()  # "head" in the results: this checkout's commit
    with tempfile.TemporaryDirectory(prefix="compare-trees-") as tmp:
        tmp = Path(tmp)
        base_tree = export_tree(args.base, tmp / "base")
        trees = {"base": (base_tree, tmp / "base" / "site"), "head": (ROOT, ROOT)}
        engines: dict[tuple[str, str], Path] = {}
        for name, (target, _, _) in SETS[args.set].items():
            for which, (tree, site) in trees.items():
                if target is not None and (which, target) not in engines:
                    engines[(which, target)] = build(tree, site, target,
                                                     tmp / f"engine-{which}-{target}")
        times = {name: {"base": [], "head": []} for name in SETS[args.set]}
        for run in range(args.runs):
            order = ("base", "head") if run % 2 == 0 else ("head", "base")
            for name, (target, cmd, key) in SETS[args.set].items():
                for which in order:
                    tree, site = trees[which]
                    engine = engines.get((which, target))
                    t = run_once(tree, site, cmd, engine, key, tmp / "scratch")
                    times[name][which].append(t)
                    print(f"run {run + 1} {which:>4} {name}: {t:.2f}", flush=True)
    results = {}
    for name, t in times.items():
        b, h = statistics.median(t["base"]), statistics.median(t["head"])
        results[name] = {"base": b, "head": h, "ratio": h / b, "base_runs": t["base"],
                         "head_runs": t["head"]}
        print(f"{name}: base {b:.2f}, head {h:.2f}, head / base {h / b:.4f}")
    doc = {"base": args.base, "head": made["commit"], "set": args.set, "runs": args.runs,
           **made, "results": results}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
