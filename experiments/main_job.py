"""The main job's reduced settings, shared by the experiments that reuse its run directory: the
test suite's main-job run (tests/test_train.py), so a test can point an experiment at that run
and reuse its parent and family."""

QUICK = {"pretrain.steps": 8, "elastic.stage1_steps": 30, "elastic.stage2_steps": 10,
         "data.batch": 4, "data.n_text": 300, "data.n_reasoning": 300, "eval.n_reasoning": 4,
         "eval.max_think_tokens": 8, "eval.max_answer_tokens": 4, "log_every": 5,
         "checkpoint.save_every": 1000}


def apply_quick(config) -> None:
  """Sets `QUICK` on an ml_collections run config, in place."""
  for key, value in QUICK.items():
    section, _, field = key.rpartition(".")
    (config[section] if section else config)[field] = value
