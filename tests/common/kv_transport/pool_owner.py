"""A prefill-side process for the cross-process transport tests (run as a script, not collected).

    python pool_owner.py {shm|cuda} SEED SHAPE BLOCK_IDS      e.g. shm 7 2,2,12,4,2,8 3,4,9

Makes a pool filled with seeded random data (generated on the CPU, so the test can regenerate it),
offers it through a KVSource, prints the handoff descriptor as one JSON line, then obeys stdin:
"scribble B" adds 1 to block B and answers "ok"; "late_scribble B" (CUDA) queues the same behind
~0.1 s of GPU work, records an interprocess event behind it and answers the event's IPC handle
(base64) without waiting; "long_scribble B" the same behind ~2 s (to be killed meanwhile);
"exit" closes the source and the pool file.
"""

from __future__ import annotations

import base64
import sys

import torch

from common.kv_transport.shm import SharedMemoryPool
from common.kv_transport.source import KVSource


def seeded_pool(seed: int, shape: list[int]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def main() -> None:
    kind, seed, shape_arg, ids_arg = sys.argv[1:5]
    shape = [int(x) for x in shape_arg.split(",")]
    block_ids = [int(x) for x in ids_arg.split(",")]
    data = seeded_pool(int(seed), shape)
    shm = None
    if kind == "shm":
        shm = SharedMemoryPool()
        pool = shm(shape, torch.float32, "cpu")
        pool.copy_(data)
    else:
        pool = data.to("cuda")
        torch.cuda.synchronize()
    source = KVSource(f"owner-{kind}", pool, "test-model", shm=shm)
    desc = source.describe("req-1", block_ids, num_tokens=len(block_ids) * shape[3] - 1,
                           block_hashes=[1, 2])
    print(desc.to_json(), flush=True)
    events = []
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "scribble":
            pool[:, :, int(cmd[1])] += 1
            if pool.is_cuda:
                torch.cuda.synchronize()
            print("ok", flush=True)
        elif cmd[0] in ("late_scribble", "long_scribble"):  # the early handoff's event
            event = torch.cuda.Event(interprocess=True)
            # ~0.1 s (~2 s) of a busy GPU before the write
            torch.cuda._sleep(int(2e8 if cmd[0] == "late_scribble" else 4e9))
            pool[:, :, int(cmd[1])] += 1
            event.record()
            print(base64.b64encode(event.ipc_handle()).decode(), flush=True)
            events.append(event)  # alive until the receiver waited for it
        elif cmd[0] == "exit":
            break
    source.close()
    if shm is not None:
        shm.close()


if __name__ == "__main__":
    main()
