"""Tools over the runtime: Spec-Bench runs with HF and llama.cpp baselines, divergence from ar, ablations, the
oracle replay's recording."""
