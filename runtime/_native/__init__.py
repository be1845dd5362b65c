"""Native CPU kernels (C over the buffer protocol): _attention for paged attention, _qlinear for quantized linears."""
