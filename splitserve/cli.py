"""`splitserve` command line: one subcommand per module under splitserve/commands.

Each command module defines `add_arguments(parser)` and `run(args) -> int`; modules are imported
only when their command runs, so `splitserve gateway` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "up": "Run the whole local stack (registry, gateway, prefill and decode services).",
    "gateway": "Run the gateway: public gRPC (and HTTP) API, tokenization, routing.",
    "prefill": "Run one prefill service.",
    "decode": "Run one decode service.",
    "generate": "Send a prompt to a running gateway and stream the answer.",
    "health": "Check a service's readiness (gRPC health, or an HTTP /health); exit 0 if ready.",
    "run-batch": "Run an OpenAI batch file (JSONL) offline through the in-process engine.",
    "bench": "Benchmark a running gateway (gRPC or HTTP) and/or HF transformers on one workload.",
}


def _module(name: str):
    return importlib.import_module(f"splitserve.commands.{name.replace('-', '_')}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Only the chosen command's module is imported (its arguments need it).
    chosen = next((a for a in argv if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        if name == chosen:
            _module(name).add_arguments(p)
    args = parser.parse_args(argv)
    if hasattr(args, "cpu_omp_spin_count"):  # before the command's run imports torch
        from common.engine.omp_env import set_spin_count
        set_spin_count(args.cpu_omp_spin_count)
    return int(_module(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
