"""GGUF quantized matrices kept as the file's blocks (Q8_0, Q5_0/Q5_1, K-quants, IQ4_XS, IQ3_S):
the C++ kernels (dequant.cpp, ops.cpp, built by build.py) and the forms a model holds
(blocks.py)."""
