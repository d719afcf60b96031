"""The offline compiler: Hugging Face safetensors checkpoints -> FTW (`ft checkpoint`)."""

from ft.compiler.checkpoint import compile_checkpoint
from ft.compiler.errors import CheckpointError

__all__ = ["CheckpointError", "compile_checkpoint"]
