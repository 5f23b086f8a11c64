"""DwarfStar: an inference engine for DeepSeek V4 Flash and PRO."""

__version__ = "0.1.0"
