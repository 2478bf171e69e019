"""casspec serve: the OpenAI-compatible app, its calls' checks, the bounded queue and worker, the guard on what
comes in, Prometheus metrics."""
