"""Compute kernels: a Triton kernel for CUDA and a torch reference for every op on the step path.

Each module holds one op family: the torch reference (`*_ref`, runs anywhere, the ground truth in
tests), the Triton implementation (`*_triton`, CUDA), and a dispatcher that picks one by device.
Nothing here imports the rest of tokenmill.
"""
