"""KV transports: move a handoff's KV blocks from a prefill engine's pool into a decode engine's.

local (same process), shm (same host, CPU), cuda_ipc (same host, GPU), grpc (anywhere); the
source offers all it can (source.KVSource), the receiver picks by locality (select.KVReceiver).
Import the submodules: this package imports nothing itself, so its torch-free parts (locality,
shm_sweep) stay importable without torch.
"""
