"""Errors a user can cause. The CLI prints them as one line; everything else is a bug and keeps its traceback."""


class PegainferError(Exception):
    """Base of every user-facing error: the message alone must tell what was expected and what was found."""


class ConfigError(PegainferError):
    """A config.json that is missing, malformed, or asks for something unsupported."""


class CheckpointError(PegainferError):
    """A checkpoint folder whose weights are missing, mis-shaped, or unreadable."""


class GraphError(PegainferError):
    """A graph that fails verification: a dangling edge, a cycle, a type that does not agree."""


class RequestError(PegainferError):
    """A generation request with bad arguments (prompt, sampling parameters, limits)."""
