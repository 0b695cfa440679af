"""Built-in commlib backends, one subpackage each, each imported only when chosen.

- ``ring``: our ring collectives in pure Python (shared memory on one host, TCP across hosts).
- ``torch``: torch.distributed, registered as ``gloo`` (CPU tensors) and ``nccl`` (CUDA
  tensors through NCCL, CPU tensors through Gloo).
- ``mpi``: mpi4py (views of CPU tensors, CuPy buffers or pinned staging for CUDA tensors).
- ``common``: what several backends share (job token, store rendezvous, kernels, CUDA staging).

Each backend subpackage exposes ``BACKENDS``: a mapping from backend name to factory. No backend
imports another.
"""
