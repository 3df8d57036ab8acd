"""A module whose import fails: reward checks name it."""

raise RuntimeError("this module cannot be imported")
