"""The CLIs: the summary job prints the size table and keeps its compiled programs; user errors
are one line."""
import os
import subprocess
import sys


def test_summary_cli(tmp_path):
  # Outside the suite's cache: the CLI's own persistent compilation cache gets the programs.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env["ELASTIC_JAX_COMPILATION_CACHE"] = str(tmp_path / "xla")
  r = subprocess.run([sys.executable, "-m", "elastic_jax.summary", "--config=tiny", "--seq_len=8"],
                     capture_output=True, text=True, timeout=300, env=env)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "full model: 924,288 total / 592,512 active params" in r.stdout
  assert r.stdout.count("|") > 20
  assert len(os.listdir(tmp_path / "xla")) > 0


def test_compilation_cache_dir():
  from elastic_jax.cli import compilation_cache_dir
  home = os.path.expanduser("~")
  assert compilation_cache_dir({}) == os.path.join(home, ".cache", "elastic_jax", "xla")
  assert compilation_cache_dir({"XDG_CACHE_HOME": "/c"}) == "/c/elastic_jax/xla"
  assert compilation_cache_dir({"ELASTIC_JAX_COMPILATION_CACHE": "/x", "XDG_CACHE_HOME": "/c"}) \
      == "/x"
  for off in ("", "0"):
    assert compilation_cache_dir({"ELASTIC_JAX_COMPILATION_CACHE": off}) is None
  # jax's own variable wins: jax reads it, we set nothing.
  assert compilation_cache_dir({"JAX_COMPILATION_CACHE_DIR": "/j",
                                "ELASTIC_JAX_COMPILATION_CACHE": "/x"}) is None


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
