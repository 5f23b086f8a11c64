"""Errors that reach users. The CLI and server print their message, never a traceback."""


class DwarfStarError(Exception):
    """Base class for every error that is the user's input, not a bug."""


class ModelFileError(DwarfStarError):
    """A GGUF or checkpoint file is unreadable, truncated, or not a DeepSeek V4 model."""


class ConfigError(DwarfStarError):
    """Model hyperparameters are missing or inconsistent."""


class ContextOverflowError(DwarfStarError):
    """More tokens than the context holds: a clear error, never a wrap or a crash."""
