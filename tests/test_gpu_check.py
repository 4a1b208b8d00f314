"""scripts/gpu_check.py, the GPU checklist's script, on toy shapes on the CPU: it must not rot between the rare runs
where a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "gpu_check.py"


def test_every_section_runs_on_toy_shapes(tmp_path):
    out = tmp_path / "gpu.json"
    subprocess.run([sys.executable, str(SCRIPT), "--small", "--device", "cpu", "--prompts", "2", "--tokens", "16",
                    "--sections", "machine,rows,engine,speed,graphs,engine_speed", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    results = json.loads(out.read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    engine = results["engine"]
    assert all(r["identical_to_eager_none"] == "2/2" for r in engine.values() if "identical_to_eager_none" in r), engine
    assert "float32/graphs/hybrid" in engine
    assert all(r["argmax_differs"] == 0 for key, r in results["rows"].items() if key.startswith("float32"))
    assert results["speed"]["engine"]["oracle k=4"]["identical"]
    assert "skipped" in results["graphs"]
    timed = results["engine_speed"]
    assert all(timed[f"{mode}/oracle k={k}"]["identical"] for mode in ("eager", "graphs") for k in (4, 8, 16)), timed
