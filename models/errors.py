"""Errors raised while loading or running models."""


class ModelError(Exception):
    """Base class of every error raised by ``models/``."""


class ModelSourceError(ModelError):
    """A model ``source`` does not name a loadable model (missing path, package or file)."""
