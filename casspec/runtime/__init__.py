"""The runtime: Engine (prompts, streams, stops), the decode step (step.py), the target the options build
(target.py), requests, the method table and policies, statistics, detokenization."""
