"""The README's first command (the summary job) runs and prints the size table."""
import subprocess
import sys


def test_summary_cli():
  r = subprocess.run([sys.executable, "-m", "elastic_jax.summary", "--config=tiny", "--seq_len=8"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "full model: 924,288 total / 592,512 active params" in r.stdout
  assert r.stdout.count("|") > 20


def test_user_errors_are_ours_library_errors_keep_their_traceback(tmp_path):
  import jax.numpy as jnp
  import pytest
  from elastic_jax import cli
  from elastic_jax.training import data
  with pytest.raises(ValueError) as ours:
    data.local_corpus([str(tmp_path / "missing.txt")])
  with pytest.raises(ValueError) as theirs:
    jnp.split(jnp.zeros(5), 2)
  assert cli.is_user_error(ours.value) and not cli.is_user_error(theirs.value)
