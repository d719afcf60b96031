"""FTW: the on-disk contract between the compiler and the runtime (specs/ftw.md)."""

from .config import FAMILIES, ModelConfig
from .errors import FtwError
from .reader import ExpertBankView, FtwReader
from .writer import FtwWriter

__all__ = ["FAMILIES", "ExpertBankView", "FtwError", "FtwReader", "FtwWriter", "ModelConfig"]
