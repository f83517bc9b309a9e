"""OMP_NUM_THREADS from a benchmark's own --threads argument, set before torch or flashattn load.

OpenMP reads OMP_NUM_THREADS once, when its runtime loads, so a script that imports torch or
flashattn at the top calls set_from_argv() first; its argparse reads --threads properly later.
"""

import os
import sys


def set_from_argv(default: str = "2") -> None:
    """Sets OMP_NUM_THREADS to the value of --threads N or --threads=N in sys.argv, else default."""
    value = default
    for i, arg in enumerate(sys.argv):
        if arg == "--threads" and i + 1 < len(sys.argv):
            value = sys.argv[i + 1]
        elif arg.startswith("--threads="):
            value = arg.split("=", 1)[1]
    os.environ["OMP_NUM_THREADS"] = value
