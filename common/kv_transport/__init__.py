"""KV transports: move a handoff's KV blocks from a prefill engine's pool into a decode engine's.

local (same process), shm (same host, CPU), cuda_ipc (same host, GPU), grpc (anywhere); the
source offers all it can (KVSource), the receiver picks by locality (KVReceiver).
"""

from common.kv_transport.base import KVTransport
from common.kv_transport.blocks import KV_LAYOUT, copy_blocks
from common.kv_transport.checksum import kv_checksum
from common.kv_transport.grpc_transport import GrpcTransport, KVTransferServicer
from common.kv_transport.locality import host_id, process_id
from common.kv_transport.select import KVReceiver, make_transport, select_transport
from common.kv_transport.shm import SharedMemoryPool
from common.kv_transport.source import KVSource

__all__ = ["KV_LAYOUT", "GrpcTransport", "KVReceiver", "KVSource", "KVTransferServicer",
           "KVTransport", "SharedMemoryPool", "copy_blocks", "host_id", "kv_checksum",
           "make_transport", "process_id", "select_transport"]
