"""Evaluation: scoring through the inference path (prefill, then decode)."""
