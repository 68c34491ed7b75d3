"""The exceptions ampwatch raises. Every message is one line: what, which file, what to do."""


class RunError(Exception):
    """A run file (or folder of runs) cannot be read: missing, not a run, corrupt, or too new."""


class OptionError(ValueError):
    """An option passed to :func:`ampwatch.attach` is invalid."""


class ArgumentTypeError(OptionError, TypeError):
    """An argument of :func:`ampwatch.attach` has the wrong type (model, optimizer, scaler, path,
    name). Also a TypeError, so code that caught the plain TypeError keeps working."""


class RunExistsError(RunError, FileExistsError):
    """``attach(path=...)`` names a file that already exists (pass ``overwrite=True`` or a new path)."""


class RunPathIsFolderError(RunError, IsADirectoryError):
    """``attach(path=...)`` names a folder: a run is one file (``overwrite=True`` never replaces a folder)."""


class OutputError(Exception):
    """A file or folder the CLI was asked to write (``--out``) cannot be written."""


class DashboardError(Exception):
    """``ampwatch dashboard`` cannot start: its extra is not installed, the runs folder is missing
    or a file, the port is not a number or is in use, the host is not an address here."""
