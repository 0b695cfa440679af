"""What several backends share: the job token and admission, the store rendezvous, kernels, CUDA staging, p2p.

- ``jobtoken``, ``admission``: who may join a job, proved without sending the secret.
- ``store_rendezvous``: the job check in front of a ``TCPStore`` (gloo/nccl, the ring under torchrun).
- ``kernels``: copies and reductions that never start torch's intra-op thread team.
- ``cuda_staging``: pinned host staging of CUDA tensors, chunked and overlapped (ring, mpi).
- ``p2p_protocol``: the point-to-point protocol (header, verdict, matching), without I/O (every backend).
"""
