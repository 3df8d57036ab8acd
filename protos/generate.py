"""Regenerate the committed control-plane modules from ``orchestr.proto``.

Usage: ``python protos/generate.py [OUT_DIR]`` (default: this folder). The staleness test calls
:func:`generate` into a temporary folder and compares the result with the committed files.
"""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
GENERATED = ("orchestr_pb2.py", "orchestr_pb2.pyi", "orchestr_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (from grpcio-tools) and fix the generated import to be package-relative."""
    from grpc_tools import protoc  # a development dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{HERE}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(HERE / "orchestr.proto"),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit status {rc}")
    grpc_module = out_dir / "orchestr_pb2_grpc.py"
    text = grpc_module.read_text()
    grpc_module.write_text(
        text.replace(
            "import orchestr_pb2 as orchestr__pb2", "from . import orchestr_pb2 as orchestr__pb2"
        )
    )
    return [out_dir / name for name in GENERATED]


if __name__ == "__main__":
    target = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for path in generate(target):
        print(path)
