"""Measuring this machine for a checkpoint: the dense kernels (tune), the latency profile (autoprofile, profile),
the levels plane and the agreement measurement, over Spec-Bench questions; they read an engine through
engine_view.EngineView and import none."""
