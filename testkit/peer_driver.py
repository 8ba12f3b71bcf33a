"""``vllm bench serve``, run cell after cell in one process: the peer client (``testkit.vllm.BenchClient``).

Runs in the real vLLM's own venv (``tests/e2e/setup_vllm.sh``), never in mmgate's. Each line on stdin is one
cell: ``{"argv": [...], "out": PATH}``, where ``argv`` is exactly what follows ``vllm bench serve`` on a
command line. The arguments are parsed by vLLM's own parser and run by vLLM's own entry point
(``vllm.benchmarks.serve.main``), the code behind ``vllm bench serve``; importing vLLM once, rather than once
per cell, saves about 15 s of start-up per cell on 2 cores. The result is written to ``out`` as JSON, then
``done`` goes to the file descriptor given as the first argument. vLLM prints to stdout and stderr.

    python -P testkit/peer_driver.py RESULT_FD < cells.jsonl   # -P: testkit/vllm.py is not vLLM
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from vllm.benchmarks.serve import add_cli_args, main  # type: ignore[import-not-found]
from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

KEPT = ("completed", "failed", "duration", "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
        "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms", "total_input_tokens", "total_output_tokens")


def run() -> None:
    answers = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    for line in sys.stdin:
        cell = json.loads(line)
        try:
            result = main(parser.parse_args(cell["argv"]))
            kept = {key: result.get(key) for key in KEPT}
            kept["errors"] = [error for error in result.get("errors", []) if error][:3]
        except BaseException:  # the orchestrator reports the cell as failed and goes on
            kept = {"fault": traceback.format_exc()[-2000:]}
        with open(cell["out"], "w") as out:
            json.dump(kept, out)
        answers.write("done\n")


if __name__ == "__main__":
    run()
