"""dsia: dynamically switchable inference acceleration: the functional Llama-family forward over a checkpoint's own
tensors, its kernels and C++ layer loop, and the draft levels derived from it on the fly (the bottom layer)."""
