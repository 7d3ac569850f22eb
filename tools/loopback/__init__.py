"""The loopback harness: R ranks of the kernels on one GPU (run.py), its cases, checks and timing statistics."""
