"""The peer: HF transformers `generate` on the same workload, in-process, in static batches.

Requests are taken in order, batch_size at a time, left-padded; each batch runs to its longest
output (EOS suppressed with min_new_tokens), and every request is credited with the time its own
last token came out. A logits processor stamps the time of every decoding step, which gives TTFT
and inter-token gaps as the online backends measure them (from the moment a request's batch
starts). All requests are there at the start (an offline run): compare with a closed-loop run of
the gateway (--request-rate inf).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LogitsProcessor

from splitserve.loadgen.backends import RequestResult
from splitserve.loadgen.datasets import BenchRequest


class _StepClock(LogitsProcessor):
    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf(model_dir: Path, requests: list[BenchRequest], batch_size: int,
           progress: bool = True) -> tuple[list[RequestResult], float]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = [RequestResult(len(r.prompt_token_ids)) for r in requests]
    bar = tqdm(total=len(requests), desc="hf", unit="req", disable=not progress,
               file=sys.stderr)
    t0 = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.max_tokens for r in batch)
        clock = _StepClock()
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=0,
                           logits_processor=[clock])
        for row, r in enumerate(batch):
            res, times = results[first + row], clock.times[:r.max_tokens]
            res.start, res.ttft = start - t0, times[0] - start
            res.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
            res.e2e, res.output_len = times[-1] - start, r.max_tokens
        bar.update(len(batch))
    bar.close()
    return results, time.perf_counter() - t0
