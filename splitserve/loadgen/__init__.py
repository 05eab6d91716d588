"""`splitserve bench`: a load generator for the gateway's gRPC and HTTP APIs, with HF transformers
on the same workload for side-by-side ratios. Its HTTP client and plots need the `bench` extra
(`pip install 'splitserve[bench]'`); `datasets` needs only the standard library.

    datasets   workloads as token ids: random lengths, shared system prompt, ShareGPT-like lengths
    backends   one streamed request over gRPC or HTTP, timed piece by piece
    hf         the same workload through HF `generate` in static padded batches (in-process)
    runner     Poisson arrivals or fixed concurrency, with a progress bar
    report     TTFT / ITL / TPOT / e2e percentiles, throughput, goodput; table, JSON, CDF plot
"""
