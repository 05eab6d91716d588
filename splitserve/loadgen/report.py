"""Benchmark figures from per-request timings: latency percentiles, throughput, goodput; printed
as a table (one column per backend, ratios against HF when it ran), written as JSON, and drawn as
latency CDFs (PNG)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.loadgen.backends import RequestResult

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True, slots=True)
class Objectives:
    """SLOs for goodput, in seconds; 0 = none."""
    ttft_s: float = 0.0
    tpot_s: float = 0.0
    e2e_s: float = 0.0

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_s, r.ttft), (self.tpot_s, r.tpot), (self.e2e_s, r.e2e))
        return all(not limit or value is None or value <= limit for limit, value in checks)


def latencies(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {"ttft": [r.ttft for r in ok if r.ttft is not None],
            "itl": [gap for r in ok for gap in r.itl],
            "tpot": [r.tpot for r in ok if r.tpot is not None],
            "e2e": [r.e2e for r in ok if r.e2e is not None]}


def summarize(results: list[RequestResult], duration_s: float,
              objectives: Objectives) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output = sum(r.output_len for r in ok)
    prompt = sum(r.prompt_len for r in ok)
    good = sum(objectives.met(r) for r in results)
    summary: dict[str, Any] = {
        "num_requests": len(results), "num_ok": len(ok), "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s, "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "prompt_tokens": prompt, "output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "goodput": good / duration_s, "goodput_fraction": good / max(len(results), 1),
        "errors": sorted({r.error for r in results if r.error}),
    }
    for name, values in latencies(results).items():
        arr = np.asarray(values, dtype=np.float64)
        summary[name] = {"mean": float(arr.mean()) if arr.size else None,
                         **{f"p{p}": float(np.percentile(arr, p)) if arr.size else None
                            for p in PERCENTILES}}
    return summary


_ROWS: list[tuple[str, str, float, bool]] = [  # label, key, scale, higher is better
    ("requests ok", "num_ok", 1.0, True),
    ("duration (s)", "duration_s", 1.0, False),
    ("requests/s", "request_throughput", 1.0, True),
    ("output tok/s", "output_throughput", 1.0, True),
    ("total tok/s", "total_token_throughput", 1.0, True),
    ("goodput (req/s)", "goodput", 1.0, True),
    ("goodput fraction", "goodput_fraction", 1.0, True),
    *[(f"{m.upper()} p{p} (ms)", f"{m}.p{p}", 1000.0, False)
      for m in LATENCIES for p in PERCENTILES],
]


def _get(summary: dict[str, Any], key: str) -> float | None:
    value: Any = summary
    for part in key.split("."):
        value = value.get(part)
        if value is None:
            return None
    return float(value)


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """One column per backend; with HF among several, a ratio column for each other backend
    (x/hf for figures where higher is better, hf/x for latencies: above 1 means x is better)."""
    names = list(summaries)
    others = [n for n in names if n != "hf"] if "hf" in summaries and len(names) > 1 else []
    header = ["metric", *names, *[f"{n}-vs-hf" for n in others]]
    lines = [header]
    for label, key, scale, higher in _ROWS:
        row = [label]
        for n in names:
            v = _get(summaries[n], key)
            row.append("-" if v is None else f"{v * scale:.4g}" if scale != 1 else f"{v:.4g}")
        for n in others:
            ours, peer = _get(summaries[n], key), _get(summaries["hf"], key)
            if not ours or not peer:
                row.append("-")
            else:
                row.append(f"{(ours / peer) if higher else (peer / ours):.2f}x")
        lines.append(row)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True)))
                     for line in lines)


def write_json(path: Path, config: dict[str, Any], summaries: dict[str, dict[str, Any]],
               results: dict[str, list[RequestResult]]) -> None:
    payload = {"config": config, "summaries": summaries,
               "requests": {n: [asdict(r) for r in rs] for n, rs in results.items()}}
    path.write_text(json.dumps(payload, indent=1))


def plot_cdfs(path: Path, results: dict[str, list[RequestResult]], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5))
    labels = {"ttft": "time to first token", "itl": "inter-token latency",
              "tpot": "time per output token", "e2e": "end-to-end latency"}
    for ax, metric in zip(axes.flat, LATENCIES, strict=True):
        for name, rs in results.items():
            values = np.sort(np.asarray(latencies(rs)[metric])) * 1000.0
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=name)
        ax.set_xlabel(f"{labels[metric]} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
