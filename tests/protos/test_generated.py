from __future__ import annotations

import pathlib
import sys

PROTOS = pathlib.Path(__file__).resolve().parents[2] / "protos"


def test_generated_modules_match_the_proto(tmp_path: pathlib.Path) -> None:
    sys.path.insert(0, str(PROTOS))
    try:
        from generate import GENERATED, generate  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(PROTOS))
    generate(tmp_path)
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        committed = (PROTOS / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run `make protos` and commit it"
