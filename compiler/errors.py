"""The one error type of the compiler: bad or unsupported input.

Every message names the file, tensor or config key at fault and, where there is a choice, what is supported, so one
line of output is enough to act on. The CLI prints the message without a traceback.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """The input checkpoint cannot be compiled (missing/corrupt file, unsupported architecture, quant or variant)."""


def supported(items) -> str:
    """`a, b, c`: a stable, human-readable list for error messages."""
    return ", ".join(sorted(str(i) for i in items))
