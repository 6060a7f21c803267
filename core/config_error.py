"""`ConfigError`: bad user input (experiment YAML, scenario file, engine argument), naming the field.

The error carries the field's path and the message separately; `str(err)` is `"<path>: <message>"`.
A caller that knows where a nested document sits gives the path its prefix with `within` (the
engine arguments `max_num_seqs` become `engine.max_num_seqs` in an experiment YAML) instead of
editing the text. It is a `ValueError`, so code that only knows "bad value" still catches it.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad field: `path` is its dotted YAML/JSON path (`workload.arrival.rate`, `backends[1]`)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        # args (path, message): `type(err)(*err.args)` rebuilds the error (SimPy re-raises an exception of a
        # simulated process that way; with the joined text alone it failed with a TypeError hiding this one)
        super().__init__(path, message)

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message

    def within(self, prefix: str) -> "ConfigError":
        """The same error (same class) for a document nested at `prefix` (`"engine"` + `"max_num_seqs"`)."""
        if not prefix:
            return self
        if not self.path:
            return type(self)(prefix, self.message)
        sep = "" if self.path.startswith("[") else "."
        return type(self)(f"{prefix}{sep}{self.path}", self.message)

    def __reduce__(self):  # picklable across sweep worker processes
        return (type(self), (self.path, self.message))


class ModelNotFoundError(FileNotFoundError):
    """The `model` field names nothing a loader can find (built-ins and local paths only, no hub).

    A `FileNotFoundError` (what `LLM(...)` users catch); `str()` is `"model: <message>"`, and
    `as_config_error()` gives the same fact as a `ConfigError` for config-driven commands."""

    path = "model"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"model: {message}")

    def as_config_error(self) -> ConfigError:
        return ConfigError(self.path, self.message)

    def __reduce__(self):
        return (type(self), (self.message,))
