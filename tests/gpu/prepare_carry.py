"""Fetch and slim the wheels the GPU check carries to a GPU machine (run here, with network).

The GPU machine reaches no package registry, and what travels with the working tree is at most
64 MiB in all. Its image has Python 3.12, a CUDA torch, numpy, attrs, pluggy, msgpack, xxhash,
pytest and hypothesis; kvframe needs besides them (versions pinned to this checkout's venv):

- ``common``: pyzmq and msgspec (kvframe's own dependencies), about 1 MB;
- ``nixl``: nixl-cu12 1.5.1, 68.7 MB as published: over the limit by itself. Its
  ``nixl_ep_cu12`` package (three builds of an expert-parallel extension, one per torch
  version, 104 MiB unpacked) and its perftest and script files are not used by kvframe and are
  dropped: about 26 MB remains (UCX with its CUDA transports, every NIXL backend plugin).
  With it the CUDA 12 runtime (3.5 MB): the image's torch is a CUDA 13 build, and UCX's CUDA
  memory hooks inside nixl-cu12 (``libucm_cuda``) link ``libcudart.so.12``;
- ``ucx`` (not carried by default): ucxx-cu12 and libucxx, libucx (slimmed: no static
  libraries, no perftest), rmm, librmm, cuda-bindings 12 and rapids-logger, 35 MiB, so
  ``nixl`` and ``ucx`` do not fit in one call together. kvframe-ucx claims ``HOST`` memory
  only, so the check cannot run its kit on CUDA anyway until it claims ``DEVICE``.

Usage (from the repository root)::

    python tests/gpu/prepare_carry.py            # common + nixl into .kvframe-gpu-wheels/
    python tests/gpu/prepare_carry.py --groups common,ucx

``.kvframe-gpu-wheels/`` is ignored by git (``/.kvframe-*``); name its group folders in the
device tool's ``carry``. Prints each wheel's size and the total against the limit.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".kvframe-gpu-wheels"
LIMIT = 64 * 2**20

#: Wheels per group, as pip requirements (the versions this checkout's venv runs).
GROUPS: dict[str, list[str]] = {
    "common": ["pyzmq==27.3.0", "msgspec==0.23.0"],
    "nixl": ["nixl-cu12==1.5.1", "nvidia-cuda-runtime-cu12==12.9.79"],
    "ucx": [
        "ucxx-cu12==0.52.0",
        "libucxx-cu12==0.52.0",
        "libucx-cu12==1.21.0",
        "rmm-cu12==26.10.0",
        "librmm-cu12==26.10.0",
        "cuda-bindings==12.9.10",
        "rapids-logger==0.3.0",
    ],
}

#: Files dropped from a wheel (regular expressions on the path inside it).
STRIP: dict[str, list[str]] = {
    "nixl_cu12": [r"^nixl_ep_cu12/", r"perftest", r"^nixl_cu12\.scripts/"],
    "libucx_cu12": [r"\.a$", r"\.la$", r"perftest", r"^libucx/bin/(?!ucx_info$)"],
}

_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35)] + [
    "manylinux2014_x86_64"
]


def _record_hash(data: bytes) -> str:
    digest = urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def slim(wheel: Path, patterns: list[str]) -> tuple[int, int]:
    """Rewrite ``wheel`` without the files matching ``patterns`` (its RECORD too); returns the
    sizes before and after."""
    before = wheel.stat().st_size
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {
            i.filename for i in src.infolist() if any(re.search(p, i.filename) for p in patterns)
        }
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [
                    line
                    for line in data.decode().splitlines()
                    if line.split(",", 1)[0] not in dropped
                ]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    tmp.replace(wheel)
    return before, wheel.stat().st_size


def download(group: str) -> list[Path]:
    """Download (no dependencies: every one is named) and slim one group's wheels."""
    folder = OUT / group
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    plats = [a for p in _PLATFORMS for a in ("--platform", p)]
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", *plats,
             "--cache-dir", cache, "-d", str(folder), *GROUPS[group]],
            check=True,
        )  # fmt: skip
    wheels = sorted(folder.glob("*.whl"))
    for w in wheels:
        dist = w.name.split("-", 1)[0]
        if dist in STRIP:
            before, after = slim(w, STRIP[dist])
            print(f"  slimmed {w.name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return wheels


def tree_bytes() -> int:
    """Bytes of what travels anyway: tracked and untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout  # fmt: skip
    return sum(
        (ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file()
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--groups", default="common,nixl", help="comma-separated (common,nixl)")
    args = parser.parse_args(argv)
    groups = [g for g in args.groups.split(",") if g]
    unknown = set(groups) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}; known: {sorted(GROUPS)}")
    total = 0
    for g in groups:
        print(f"{g}:")
        for w in download(g):
            size = w.stat().st_size
            total += size
            print(f"  {w.name}  {size / 2**20:.1f} MiB")
    tree = tree_bytes()
    print(f"wheels {total / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB "
          f"= {(total + tree) / 2**20:.1f} MiB of {LIMIT / 2**20:.0f} MiB")  # fmt: skip
    if total + tree > LIMIT:
        print("over the limit: carry fewer groups per call", file=sys.stderr)
        return 1
    print("carry: " + ", ".join(f".kvframe-gpu-wheels/{g}" for g in groups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
