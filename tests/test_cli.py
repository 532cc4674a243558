"""The README's first command (the summary job) runs and prints the size table."""
import subprocess
import sys


def test_summary_cli():
  r = subprocess.run([sys.executable, "-m", "elastic_jax.summary", "--config=tiny", "--seq_len=8"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "full model: 924,288 total / 592,512 active params" in r.stdout
  assert r.stdout.count("|") > 20
