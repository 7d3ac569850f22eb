"""Developer tools of jax-moe-overlap (not shipped): the loopback harness, probes, comparisons."""
