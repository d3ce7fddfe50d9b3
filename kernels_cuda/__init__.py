"""kernels_cuda"""
