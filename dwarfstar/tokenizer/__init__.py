"""The DeepSeek V4 tokenizer, stored in and loaded from GGUF metadata."""

from dwarfstar.tokenizer.detokenizer import IncrementalDetokenizer
from dwarfstar.tokenizer.specials import Control, PromptPart
from dwarfstar.tokenizer.tokenizer import Tokenizer, TokenizerError

__all__ = ["Control", "IncrementalDetokenizer", "PromptPart", "Tokenizer", "TokenizerError"]
