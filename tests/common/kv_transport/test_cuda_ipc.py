"""GPU paths: cuda_ipc between two processes, and the CUDA sides of the checksum and block copy."""

from __future__ import annotations

import pytest
import torch

from common.errors import TransferError
from common.kv_transport.blocks import WaitingStreams, copy_blocks
from common.kv_transport.checksum import combine, kv_checksum
from common.kv_transport.select import KVReceiver

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPE = [2, 2, 12, 4, 2, 8]  # layers, kv, blocks, block_size, kv_heads, head_dim


def _seeded_pool(seed: int, shape: list[int]) -> torch.Tensor:
    """The data pool_owner.py fills its pool with."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_agrees_across_devices(dtype: torch.dtype) -> None:
    pool = _seeded_pool(3, SHAPE).to(dtype)
    ids = [11, 0, 5, 6, 7]
    assert kv_checksum(pool.cuda(), ids) == kv_checksum(pool, ids)


def test_copy_blocks_on_gpu() -> None:
    src = _seeded_pool(4, SHAPE).cuda()
    src_ids = list(range(11, -1, -1))
    dst_ids = [(5 * i) % 12 for i in range(12)]
    for dst_pool_ids in (dst_ids, dst_ids[:3]):
        dst = torch.zeros_like(src)
        copy_blocks(src, src_ids[:len(dst_pool_ids)], dst, dst_pool_ids)
        for s, d in zip(src_ids, dst_pool_ids, strict=False):
            assert torch.equal(dst[:, :, d], src[:, :, s])


def test_cuda_ipc_pull_from_another_process(pool_owner) -> None:
    owner = pool_owner("cuda", 11, SHAPE, [3, 4, 9, 0])
    desc = owner.desc
    assert sorted(desc.transports) == ["cuda_ipc", "local"]
    dst = torch.zeros([2, 2, 8, 4, 2, 8], device="cuda")
    receiver = KVReceiver()
    assert receiver.pull(desc, dst, [6, 1, 2, 7]) == "cuda_ipc"
    want = _seeded_pool(11, SHAPE)
    for s, d in [(3, 6), (4, 1), (9, 2), (0, 7)]:
        assert torch.equal(dst[:, :, d].cpu(), want[:, :, s])
    assert int(torch.count_nonzero(dst[:, :, [0, 3, 4, 5]])) == 0

    dst.zero_()
    assert receiver.pull(desc, dst, [0, 1, 2, 3]) == "cuda_ipc"  # the opened handle is reused
    assert torch.equal(dst[:, :, 2].cpu(), want[:, :, 9])

    assert owner.command("scribble 9") == "ok"
    with pytest.raises(TransferError, match="checksum mismatch"):
        receiver.pull(desc, dst, [6, 1, 2, 7])
    receiver.close()
    assert owner.exit() == 0


def test_an_early_copy_waits_for_the_sources_event(pool_owner) -> None:
    """The early handoff's mechanism (decode_service/handoff.py): the source records an
    interprocess event behind work still running; the receiver prepares the copy meanwhile
    (ids uploaded, host buffer), waits for the event on the host, then launches the copy with
    its sums, and gets the blocks as written by that work."""
    import base64
    owner = pool_owner("cuda", 12, SHAPE, [3, 4, 9, 0])
    desc = owner.desc
    transport = KVReceiver().transport("cuda_ipc")
    handle = base64.b64decode(owner.command("late_scribble 9"))
    offer = desc.transports["cuda_ipc"]
    dst = torch.zeros([2, 2, 8, 4, 2, 8], device="cuda")
    launch = transport.prepare_copy(offer, list(desc.block_ids), dst, [6, 1, 2, 7])
    transport.open_event(offer, handle).synchronize()
    host, done = launch()
    done.synchronize()
    want = _seeded_pool(12, SHAPE)
    want[:, :, 9] += 1
    for s, d in [(3, 6), (4, 1), (9, 2), (0, 7)]:
        assert torch.equal(dst[:, :, d].cpu(), want[:, :, s])
    assert combine(host.tolist()) == kv_checksum(want, [3, 4, 9, 0])
    with pytest.raises(TransferError, match="outside the pools"):
        transport.prepare_copy(offer, [12], dst, [0])
    transport.close()
    assert owner.exit() == 0


def test_an_early_copy_queued_at_once_waits_on_the_device(pool_owner) -> None:
    """--early-copy-on-device: the copy is queued before the source's work ends, on a stream of
    its own that waits for the source's interprocess event on the device; it copies the blocks
    as that work wrote them. The stream is handed out again only once its copy completed. (The
    source's work lasts ~2 s: a first launch in this process may compile its kernel.)"""
    import base64
    owner = pool_owner("cuda", 12, SHAPE, [3, 4, 9, 0])
    desc = owner.desc
    transport = KVReceiver().transport("cuda_ipc")
    handle = base64.b64decode(owner.command("long_scribble 9"))
    offer = desc.transports["cuda_ipc"]
    dst = torch.zeros([2, 2, 8, 4, 2, 8], device="cuda")
    streams = WaitingStreams()
    stream = streams.take(dst.device)
    with torch.cuda.stream(stream):
        launch = transport.prepare_copy(offer, list(desc.block_ids), dst, [6, 1, 2, 7],
                                        transport.open_event(offer, handle))
        host, done = launch()
    streams.give(stream, done)
    assert not done.query()  # the source's ~2 s of work is still running
    assert streams.take(dst.device) is not stream
    done.synchronize()
    want = _seeded_pool(12, SHAPE)
    want[:, :, 9] += 1
    for s, d in [(3, 6), (4, 1), (9, 2), (0, 7)]:
        assert torch.equal(dst[:, :, d].cpu(), want[:, :, s])
    assert combine(host.tolist()) == kv_checksum(want, [3, 4, 9, 0])
    assert streams.take(dst.device) is stream  # completed: reused
    transport.close()
    assert owner.exit() == 0


def test_a_source_that_dies_mid_step_strands_only_its_copys_stream(pool_owner) -> None:
    """The early copy's stream waits for an event of a source killed before recording it: the
    rest of this process (the default stream, other streams, a later early copy) goes on, and
    that stream is never handed out again while its copy has not completed. Prints whether the
    driver ended the wait when the source died (it is not relied upon)."""
    import base64
    import time
    owner = pool_owner("cuda", 12, SHAPE, [3, 4, 9, 0])
    desc = owner.desc
    transport = KVReceiver().transport("cuda_ipc")
    handle = base64.b64decode(owner.command("long_scribble 9"))
    offer = desc.transports["cuda_ipc"]
    dst = torch.zeros([2, 2, 8, 4, 2, 8], device="cuda")
    streams = WaitingStreams()
    stream = streams.take(dst.device)
    with torch.cuda.stream(stream):
        _, done = transport.prepare_copy(offer, list(desc.block_ids), dst, [6, 1, 2, 7],
                                         transport.open_event(offer, handle))()
    streams.give(stream, done)
    assert not done.query()  # the source's ~2 s of work is still running
    owner.kill()
    x = torch.ones(4, device="cuda")
    assert (x + 1).sum().item() == 8  # the default stream goes on
    other = streams.take(dst.device)
    assert other is not stream or done.query()
    with torch.cuda.stream(other):
        y = torch.full((4,), 2.0, device="cuda") * 3
    other.synchronize()
    assert y.sum().item() == 24
    start = time.monotonic()
    while not done.query() and time.monotonic() - start < 8:
        time.sleep(0.01)
    print(f"the dead source's wait {'ended' if done.query() else 'still pending'} after "
          f"{time.monotonic() - start:.2f} s")
    transport.close()
