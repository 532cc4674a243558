"""Peak host memory of the HF import (`io.hf.load_pretrained`) against the params it returns.

Writes a Nemotron-H folder (config.json + bf16 safetensors, hub layout with per-expert tensors)
with Nemotron 3 Nano's real widths and vocabulary and one layer of each kind (M, *, E: 128
experts of 1856), then imports it in a fresh process and reads the process's peak RSS (VmHWM)
above what it held before the import. An import that upcasts everything to fp32 before casting
back peaks near 3x the params; a streaming one within about one tensor of them.

  python experiments/hf_import_memory.py            # real widths (~4 GB on disk, ~12 GB RAM)
  python experiments/hf_import_memory.py --reduced  # small widths, seconds (CI)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags

flags.DEFINE_bool("reduced", False, "small widths for a quick run")
flags.DEFINE_string("workdir", None, "where to write the folder (default: a temp dir)")
flags.DEFINE_string("measure", None, "internal: import this folder and print JSON")
FLAGS = flags.FLAGS


def config(reduced: bool):
  from configs import nano_v3
  kw = dict(layer_pattern="M*E", hidden_choices=(), mamba_head_choices=(), expert_choices=(),
            moe_ffn_choices=(), budgets=(("full", 1.0),), scan_layers=False)
  if reduced:
    kw.update(hidden_size=256, vocab_size=4096, mamba_num_heads=16, mamba_head_dim=16,
              ssm_state_size=16, num_attention_heads=8, head_dim=32, n_routed_experts=16,
              moe_intermediate_size=128, moe_shared_expert_intermediate_size=256)
  return nano_v3.MODEL.replace(**kw)


def write_folder(folder: str, cfg) -> int:
  """Random bf16 weights of `cfg` saved as a HF folder; returns the bytes on disk."""
  import jax
  import ml_dtypes
  import numpy as np

  from elastic_jax.io import hf
  from elastic_jax.io import safetensors_io as st
  from elastic_jax.model.model import param_shapes

  rs = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.02 * rs.standard_normal(s.shape, np.float32)).astype(
      ml_dtypes.bfloat16), param_shapes(cfg))
  tensors = hf.params_to_hf(params, cfg)
  del params
  os.makedirs(folder, exist_ok=True)
  st.save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
  del tensors
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(hf.config_to_hf(cfg), f)
  return os.path.getsize(os.path.join(folder, "model.safetensors"))


def _rss_kib(field: str) -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) for line in f if line.startswith(field))


def measure(folder: str) -> dict:
  """Imports `folder`; bytes of the params, of the largest tensor, and the peak RSS above the
  RSS before the import."""
  import jax
  import numpy as np

  from elastic_jax.io import hf
  before = _rss_kib("VmRSS:")
  _, params = hf.load_pretrained(folder)
  leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
  return {"params": sum(x.nbytes for x in leaves), "largest": max(x.nbytes for x in leaves),
          "peak_above": (_rss_kib("VmHWM:") - before) * 1024, "before": before * 1024}


def main(argv):
  del argv
  if FLAGS.measure:
    print(json.dumps(measure(FLAGS.measure)))
    return
  cfg = config(FLAGS.reduced)
  folder = os.path.join(FLAGS.workdir or tempfile.mkdtemp(), "hf")
  disk = write_folder(folder, cfg)
  out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--measure={folder}"],
                       capture_output=True, text=True, check=True, cwd=os.getcwd())
  m = json.loads(out.stdout.strip().splitlines()[-1])
  gb = lambda b: f"{b / 1e9:.3f}"
  print(f"pattern {cfg.layer_pattern}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
        f"{cfg.n_routed_experts} experts of {cfg.moe_intermediate_size}, {cfg.param_dtype}")
  print("| on disk GB | params GB | largest tensor GB | peak RSS above start GB | "
        "peak / params | (peak - params) / largest tensor |")
  print("|---:|---:|---:|---:|---:|---:|")
  print(f"| {gb(disk)} | {gb(m['params'])} | {gb(m['largest'])} | {gb(m['peak_above'])} | "
        f"{m['peak_above'] / m['params']:.2f} | "
        f"{(m['peak_above'] - m['params']) / m['largest']:.2f} |")


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
