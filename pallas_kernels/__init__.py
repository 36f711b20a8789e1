"""Pallas kernels (TPU and GPU) for the Orthros prefill and exact decode."""
