"""Regenerate the committed protobuf and gRPC code from ``protos/sarcomm/v1/*.proto``.

Run ``python protos/generate.py`` after editing a ``.proto``; CI runs it and fails when the
committed files differ (``python protos/generate.py --check``). The pinned grpcio-tools and
mypy-protobuf in ``pyproject.toml`` keep the output identical on every machine.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "sarcomm" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _generate_into(out_dir: Path) -> list[Path]:
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p.relative_to(PROTO_ROOT)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the messages above")
    return sorted(p for p in (out_dir / "sarcomm" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        generated = _generate_into(Path(tmp))
        stale = [
            p.name
            for p in generated
            if not (PACKAGE_DIR / p.name).exists() or not filecmp.cmp(p, PACKAGE_DIR / p.name, shallow=False)
        ]
        if args.check:
            if stale:
                print(
                    f"stale generated code: {', '.join(stale)}; run python protos/generate.py",
                    file=sys.stderr,
                )
                return 1
            print("generated code is fresh")
            return 0
        for path in generated:
            shutil.copyfile(path, PACKAGE_DIR / path.name)
        print(f"wrote {len(generated)} files to {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
