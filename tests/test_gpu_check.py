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
                    "--sections", "machine,rows,engine,speed,graphs", "--out", str(out)], check=True,
                   capture_output=True, timeout=300)
    results = json.loads(out.read_text())
    assert not [name for name, r in results.items() if "error" in r], results
    engine = results["engine"]
    assert all(r["identical"] == "2/2" for key, r in engine.items() if "identical" in r), engine
    assert all(r["argmax_differs"] == 0 for key, r in results["rows"].items() if key.startswith("float32"))
    assert results["speed"]["engine"]["oracle k=4"]["identical"]
    assert "skipped" in results["graphs"]
