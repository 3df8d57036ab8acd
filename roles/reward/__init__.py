"""The reward role: a stateless mesh that scores samples with a scorer named by path."""

from ._actor import DEFAULT_SCORER, Reward, load_scorer

__all__ = ["DEFAULT_SCORER", "Reward", "load_scorer"]
