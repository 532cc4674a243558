"""Checkpoints (Orbax, nested prefix restore) and Hugging Face Nemotron-H safetensors interop."""
