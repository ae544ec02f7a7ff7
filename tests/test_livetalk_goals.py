"""scripts/livetalk_goals.py over the committed raw results gives the committed goals file:
the figures docs/PERFORMANCE.md quotes follow from their sources, and a goal's verdict from
its figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "livetalk"


@pytest.mark.parametrize("name", ["goals_livetalk-1.3b_h200_d267961.json",
                                  "goals_livetalk-1.3b_h200_e697b43.json",
                                  "goals_livetalk-1.3b_h200_2aedd55.json",
                                  "goals_livetalk-1.3b_h200_e522ee3.json",
                                  "goals_livetalk-1.3b_h200_bbae9a3.json"])
def test_goals_follow_from_the_raw_results(tmp_path, name):
    committed = json.loads((RESULTS / name).read_text())
    src = committed["sources"]
    out = tmp_path / "goals.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "livetalk_goals.py"),
                    "--profile", str(RESULTS / src["profile"]),
                    "--latency", *(str(RESULTS / p) for p in src["latency"]),
                    "--startup", str(RESULTS / src["startup"]),
                    "--decoder", str(RESULTS / src["decoder"]), "--out", str(out)],
                   check=True, capture_output=True)
    assert json.loads(out.read_text()) == committed
