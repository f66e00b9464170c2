"""The one exception type a stage raises for a reason the user can act on."""


class StageError(Exception):
    """A failure reported as one line (file, row or param named), exit status 1."""
