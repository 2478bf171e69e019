"""Reading checkpoints: HF folders and GGUF files (checkpoints.py, their dequantized cache), the weights read
straight into the runtime, a GGUF's checked bytes, native quantized kernels, the levels' stored copies."""
