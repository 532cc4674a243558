"""Data, distillation losses, the resumable loop, the training phases and evaluation."""
