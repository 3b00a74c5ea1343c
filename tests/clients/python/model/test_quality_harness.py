"""bench/quality/run.py --small against the real server: the harness runs end to end and writes
its CSV, markdown table and plots, with the full-cache reference and sane measurements."""

import csv
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))


def test_small_configuration_writes_csv_table_and_plots(server, model, tmp_path):
    # `model` makes sure the GGUF is fetched (or the test skips) before the subprocess loads it.
    out = tmp_path / "results"
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "quality", "run.py"), "--small",
         "--server", server.address, "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("results.csv", "results.md", "passkey.png", "kl.png", "top1.png"):
        assert (out / name).stat().st_size > 0, name
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["policy"] for r in rows} == {"full", "streaming_llm", "snapkv"}
    assert not [r for r in rows if r["error"]], rows
    full = [r for r in rows if r["policy"] == "full"]
    assert [r["correct"] for r in full if r["task"] == "passkey"] == ["1"]
    for r in rows:
        kept, whole = int(r["kv_bytes_kept"]), int(r["kv_bytes_full"])
        if r["policy"] == "full":
            assert kept == whole
        else:  # 25% of the prompt per layer
            assert 0.2 * whole < kept < 0.3 * whole, r
        if r["task"] == "fidelity" and r["policy"] != "full":
            assert 0.0 < float(r["mean_kl"]) < 5.0 and 0.0 < float(r["top1"]) <= 1.0
    assert "| streaming_llm | 25% |" in (out / "results.md").read_text()
