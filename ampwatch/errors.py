"""The exceptions ampwatch raises. Every message is one line: what, which file, what to do."""


class RunError(Exception):
    """A run file (or folder of runs) cannot be read: missing, not a run, corrupt, or too new."""


class OptionError(ValueError):
    """An option passed to :func:`ampwatch.attach` is invalid."""


class RunExistsError(RunError, FileExistsError):
    """``attach(path=...)`` names a file that already exists (pass ``overwrite=True`` or a new path)."""
