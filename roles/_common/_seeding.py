"""Seeds derived from a tuple of keys, so every random draw can be named rather than ordered.

A prompt is keyed by ``(seed, step, index)`` and a sample by ``(seed, step, prompt, sample)``:
whichever process draws it, in whatever batch, it gets the same numbers. That is what lets a
distributed run in sync mode reproduce a single-process run of the same seed.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_seed"]

_MASK_63 = (1 << 63) - 1


def derive_seed(domain: str, *keys: int) -> int:
    """A 63-bit seed from a domain name and integer keys; pure and stable across platforms.

    The domain keeps streams apart (``"prompt"`` and ``"sample"`` with equal keys differ).
    Raises ``TypeError`` for a key that is not an ``int`` (a float step would silently collide
    with its rounded neighbour otherwise).
    """
    for key in keys:
        if not isinstance(key, int) or isinstance(key, bool):
            raise TypeError(f"seed keys must be ints, got {key!r} ({type(key).__name__})")
    text = domain + ":" + ",".join(str(k) for k in keys)
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK_63
