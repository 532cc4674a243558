"""The per-budget report table: one target or several."""
from elastic_jax.training.evaluate import markdown_table


def _row(budget, target, targets):
  return {"budget": budget, "target": target, "targets": targets,
          "counts": {"hidden": 64, "mamba_heads": 8, "moe_experts": 4, "moe_ffn": 48},
          "total_params": 1000, "active_params": 500, "active_ratio": 0.5, "total_ratio": 0.4,
          "val_loss": 2.5, "val_ppl": 12.18, "answer_acc": 0.25}


def test_markdown_table_one_and_several_targets():
  lines = markdown_table([_row("small", 0.56, {"active": 0.56}),
                          _row("12B", 0.56, {"active": 0.56, "total": 0.38})]).splitlines()
  assert lines[0].startswith("| budget | target | counts (hidden, mamba_heads, moe_experts")
  assert lines[2] == ("| small | 0.56 | 64, 8, 4, 48 | 1,000 | 500 | 0.500 | 2.500 | 12.2 | "
                      "0.250 |")
  assert lines[3].startswith("| 12B | active 0.56, total 0.38 | 64, 8, 4, 48 |")
