"""The CPU's kernels: C++ (AVX2 + FMA or AVX-512, OpenMP) built once per machine by native.py and called
through ctypes; tensors in, tensors out."""
