"""Built-in commlib backends, each imported only when chosen.

- ``ring``: ring all-reduce in pure Python (shared memory on one host, TCP across hosts).
- ``nccl`` / ``gloo``: torch.distributed (NCCL for CUDA tensors, Gloo for CPU tensors).
- ``mpi``: mpi4py (NumPy views for CPU tensors, CuPy buffers for CUDA tensors).

Each module exposes ``BACKENDS``: a mapping from backend name to factory.
"""
