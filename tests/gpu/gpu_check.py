"""The GPU check: kvframe's VRAM paths on a CUDA machine, each step reported and every byte checked.

Run it as ``python tests/gpu/gpu_check.py [--dry-run] [--json]`` from the repository root (on
the GPU machine through ``tests/gpu/run.sh``, which first installs the carried wheels; see
``docs/gpu.md``). Steps, each in a child interpreter of its own (ucxx and NIXL must not share a
process, and UCX reads its settings when it starts):

1. ``environment`` — Python, torch and its CUDA, the GPU, every package the steps need (present,
   with its version, or missing), the transports the plugin host finds and their memory kinds.
2. ``nixl_vram_registration`` — a CUDA tensor registered with NIXL: through kvframe's NIXL
   transport (``DEVICE`` → ``VRAM``, a prepared layout) and with a raw NIXL agent.
3. ``conformance_inprocess`` / ``conformance_nixl`` / ``conformance_ucx`` — kvframe's
   transport conformance kit with every buffer a CUDA tensor (``check_conformance.py``): the
   in-process transport's CUDA copy, NIXL ``VRAM`` between two processes, ucxx; for a
   transport whose capability card lacks ``DEVICE`` the step says so instead of running.
4. ``transfer_vram`` — ``kvframe bench transfer`` with both pools in VRAM and its byte checks on
   (``measure(device="cuda", verify=True)``): VRAM→VRAM between two processes through the P/D
   connector, the kvframe transport and raw NIXL with the same prepared lists, 64 KiB … 2 MiB
   blocks, 1 … 256 per request; the ratios pd_connector/raw_nixl and kvframe/raw_nixl.
5. ``ucx_transports`` — which UCX transports NIXL's UCX selected for that transfer, read from
   UCX's own protocol tables (``UCX_PROTO_INFO=y``, one log file per process): ``cuda_ipc`` or
   ``cuda_copy`` for device memory passes; device memory through shared memory (``sysv``,
   ``posix``, ``cma``) or ``tcp`` only is the silent fallback and fails.
6. ``offload_cpu_tier`` — the offloading connector's CPU tier (pinned host memory) GPU → CPU →
   GPU against torch ``copy_`` of the same bytes (``offload_check.py``).

Without a CUDA device (or with ``--dry-run``) every GPU step is reported ``not applicable`` with
the reason, and the same code runs on host memory at small sizes, so argument parsing, the
pipelines, the byte checks and the report are exercised before any GPU time is spent. Exit
status: 0 when nothing failed or is missing (and, without ``--dry-run``, the GPU steps ran), 1
otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

PASSED, FAILED, NOT_APPLICABLE, MISSING = "passed", "failed", "not applicable", "missing"

#: Import name -> distribution, for every package a step needs.
PACKAGES = {
    "torch": "torch",
    "numpy": "numpy",
    "attrs": "attrs",
    "pluggy": "pluggy",
    "msgpack": "msgpack",
    "zmq": "pyzmq",
    "msgspec": "msgspec",
    "xxhash": "xxhash",
    "pytest": "pytest",
    "hypothesis": "hypothesis",
    "kvframe": "kvframe",
    "kvframe_nixl": "kvframe-nixl",
    "kvframe_ucx": "kvframe-ucx",
    "nixl_cu12": "nixl-cu12",
    "ucxx": "ucxx-cu12",
}
BASE = ["torch", "numpy", "attrs", "pluggy", "msgpack", "zmq", "msgspec", "xxhash", "kvframe"]
KIT = [*BASE, "pytest", "hypothesis"]
#: What each transport's kit needs besides :data:`KIT` (its binding's site folder, if any).
BINDINGS = {
    "inprocess": [],
    "nixl": ["kvframe_nixl", "nixl_cu12"],
    "ucx": ["kvframe_ucx", "ucxx"],
}

#: Per-binding site folders ``run.sh`` installs into (``KVFRAME_GPU_SITE``): ``common`` for
#: every step, then ``nixl`` or ``ucx`` for the steps of that binding.
SITE_ENV = "KVFRAME_GPU_SITE"

#: Where each step's block sizes etc. differ between a GPU run and the dry run.
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "transfer": {
            "block_sizes": [64 << 10, 256 << 10, 1 << 20, 2 << 20],
            "blocks": [1, 4, 16, 64, 256],
            "repeats": 3,
            "descriptor_counts": [1, 64, 256],
            "overlap_bytes": 64 << 20,
            "pool_bytes": 512 << 20,
            "scrub_bytes": 1 << 20,
        },
        "offload": {"blocks": 256, "layers": 8, "layer_block_bytes": 256 << 10, "repeat": 3},
        "kit_select": {"inprocess": None, "nixl": None, "ucx": None},
    },
    "dry": {
        "transfer": {
            "block_sizes": [64 << 10, 256 << 10],
            "blocks": [1, 8],
            "repeats": 1,
            "descriptor_counts": [1, 16],
            "overlap_bytes": 4 << 20,
            "pool_bytes": 8 << 20,
            "scrub_bytes": 1 << 20,
        },
        "offload": {"blocks": 16, "layers": 2, "layer_block_bytes": 64 << 10, "repeat": 1},
        # a few of the kit's tests (each starts a child endpoint, seconds on two cores): enough
        # to run every piece of check_conformance.py and torch_endpoint.py
        "kit_select": {
            "inprocess": None,  # the whole kit: no child process, a fake clock, seconds
            "nixl": "on_the_device or post_with_notification",
            "ucx": "on_the_device",
        },
    },
}

#: Every step, in the order they run (``--only`` names some of them; ``environment`` always runs).
STEPS = (
    "environment",
    "nixl_vram_registration",
    "conformance_inprocess",
    "conformance_nixl",
    "conformance_ucx",
    "transfer_vram",
    "ucx_transports",
    "offload_cpu_tier",
)

#: Transports of UCX that move device memory directly, and those that mean a host bounce.
CUDA_TLS = {"cuda_ipc", "cuda_copy", "gdr_copy"}
HOST_TLS = {"sysv", "posix", "cma", "knem", "xpmem", "tcp"}


def _result(name: str, status: str, reason: str = "", **details: Any) -> dict[str, Any]:
    return {"name": name, "status": status, "reason": reason, "details": details}


# -- running steps in children ----------------------------------------------------------------


class Runner:
    """Runs step bodies (``python gpu_check.py _step NAME ...``) in child interpreters with the
    right ``PYTHONPATH`` for their binding, and collects their JSON answers."""

    def __init__(
        self, device: str, sizes: dict[str, Any], timeout: float, deadline: float | None = None
    ) -> None:
        self.device = device
        self.sizes = sizes
        self.timeout = timeout
        self.deadline = deadline
        """``time.monotonic()`` by which every step must have ended (``--deadline``)."""

    def _limit(self, timeout: float | None) -> float:
        limit = timeout or self.timeout
        if self.deadline is not None:
            limit = min(limit, self.deadline - time.monotonic())
        return max(limit, 1.0)

    def env(self, binding: str | None, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        paths = [str(ROOT)]  # kvframe itself from this working tree
        site = os.environ.get(SITE_ENV)
        if site:
            paths.append(str(Path(site) / "common"))
            if binding:
                paths.append(str(Path(site) / binding))
        paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def child(
        self,
        argv: list[str],
        binding: str | None,
        extra_env: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> tuple[int, str]:
        """Run ``argv`` (a Python command line) in a child; returns (status, output)."""
        try:
            proc = subprocess.run(
                [sys.executable, *argv],
                cwd=ROOT,
                env=self.env(binding, extra_env),
                capture_output=True,
                text=True,
                timeout=self._limit(timeout),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or "") + (exc.stderr or "")
            out = out if isinstance(out, str) else out.decode(errors="replace")
            return 124, out + f"\n(timed out after {exc.timeout} s)"
        return proc.returncode, proc.stdout + proc.stderr

    def missing(self, names: list[str], binding: str | None) -> list[str]:
        """The import names of ``names`` a child for ``binding`` would not find."""
        probe = (
            "import importlib.util, json, sys; "
            "print(json.dumps([n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]))"
        )
        status, out = self.child(["-c", probe, *names], binding, timeout=120)
        if status != 0:
            return list(names)
        found: list[str] = json.loads(out.strip().splitlines()[-1])
        return found

    def step(
        self, name: str, binding: str | None, extra_env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Run the body of step ``name`` in a child; its answer (or a failure with its output)."""
        with tempfile.TemporaryDirectory(prefix="kvframe-gpu-") as tmp:
            answer = Path(tmp) / "answer.json"
            args = [str(Path(__file__)), "_step", name, self.device, json.dumps(self.sizes)]
            status, out = self.child([*args, str(answer)], binding, extra_env)
            if answer.exists():
                result: dict[str, Any] = json.loads(answer.read_text())
                return result
        return _result(
            name, FAILED, f"the step's child exited with status {status}", tail=out[-4000:]
        )


def _missing_result(name: str, missing: list[str]) -> dict[str, Any]:
    dists = ", ".join(f"{m} (pip: {PACKAGES.get(m, m)})" for m in missing)
    return _result(
        name,
        MISSING,
        f"missing: {dists}; carry it (tests/gpu/prepare_carry.py) or install it, then rerun",
        missing=missing,
    )


# -- step bodies (run in the children) -------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def body_environment(device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    info["packages"] = {
        n: (_version(d) or "present") if importlib.util.find_spec(n) else None
        for n, d in PACKAGES.items()
    }
    import torch

    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        info["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    from kvframe.runtime.plugins import PluginHost

    host = PluginHost()
    host.load()
    info["transports"] = {
        name: sorted(k.name for k in host.transport_info(name).capabilities.memory_kinds)
        for name in host.transport_names()
    }
    return _result("environment", PASSED, **info)


def body_nixl_vram_registration(device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.transport import BlockLayout, MemoryKind, MemoryRegion, TransportParams

    t = torch.arange(1 << 20, dtype=torch.int32, device=device).view(torch.uint8)
    region = MemoryRegion.from_tensor(t)
    want = MemoryKind.DEVICE if device.startswith("cuda") else MemoryKind.HOST
    if region.kind is not want:
        return _result("nixl_vram_registration", FAILED, f"the tensor's region is {region.kind}")
    host = PluginHost()
    host.load()
    tr = host.create_transport("nixl", TransportParams(name=f"gpu-check-{os.getpid()}"))
    try:
        tr.register_memory([region])
        tr.prepare_local(
            BlockLayout(regions=[region], block_lens=[64 << 10], num_blocks=region.length >> 16)
        )
    finally:
        tr.close()
    import nixl_cu12

    mem = "VRAM" if want is MemoryKind.DEVICE else "DRAM"
    agent = nixl_cu12.nixl_agent(
        f"gpu-check-raw-{os.getpid()}", nixl_cu12.nixl_agent_config(enable_prog_thread=False)
    )
    reg = agent.register_memory(
        np.array([[region.addr, region.length, region.device_id]], dtype=np.uint64), mem
    )
    agent.deregister_memory(reg)
    return _result(
        "nixl_vram_registration",
        PASSED,
        kind=region.kind.name,
        nixl_memory=mem,
        bytes=region.length,
    )


def body_transfer(device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    from kvframe.bench import transfer

    cfg = sizes["transfer"]
    config = transfer.BenchConfig(**cfg)
    report = transfer.measure(config, device=device, verify=True)
    ratios = [
        {
            "block_bytes": row["block_bytes"],
            "blocks": row["blocks"],
            "pd_connector_gbps": row["results"]["pd_connector"]["gbps"],
            "kvframe_gbps": row["results"]["kvframe"]["gbps"],
            "raw_nixl_gbps": row["results"]["raw_nixl"]["gbps"],
            "pd_connector/raw_nixl": row["ratios"]["pd_connector/raw_nixl"],
            "kvframe/raw_nixl": row["ratios"]["kvframe/raw_nixl"],
        }
        for row in report["throughput"]
    ]
    v = report["verify"]
    status = FAILED if v["mismatches"] or v["bytes"] == 0 else PASSED
    reason = f"wrong bytes after: {', '.join(v['mismatches'])}" if v["mismatches"] else ""
    return _result(
        "transfer", status, reason, rows=ratios, verify=v, table=transfer.format_report(report)
    )


def body_offload(device: str, sizes: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import offload_check

    out = offload_check.measure(device, **sizes["offload"])
    if device.startswith("cuda") and not out["tier_pinned"]:
        return _result(
            "offload", FAILED, "the cpu tier is not pinned although CUDA is present", **out
        )
    return _result("offload", PASSED, **out)


BODIES = {
    "environment": body_environment,
    "nixl_vram_registration": body_nixl_vram_registration,
    "transfer": body_transfer,
    "offload": body_offload,
}


def run_body(name: str, device: str, sizes_json: str, answer: str) -> int:
    """The child side of :meth:`Runner.step`: run a body, write its result (or the error)."""
    sizes = json.loads(sizes_json)
    t0 = time.monotonic()
    try:
        result = BODIES[name](device, sizes)
    except Exception as exc:
        import traceback

        result = _result(
            name, FAILED, f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:]
        )
    result["seconds"] = round(time.monotonic() - t0, 2)
    Path(answer).write_text(json.dumps(result))
    return 0


# -- UCX protocol tables ----------------------------------------------------------------------

_TABLE_LINE = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*(\|.*\|)\s*$")
_TL = re.compile(r"\b([a-z][a-z0-9_]*)/[A-Za-z0-9_:.\-]+")


def parse_proto_tables(text: str) -> list[dict[str, Any]]:
    """UCX's protocol selection tables (``UCX_PROTO_INFO=y``) in a log: one entry per table,
    ``{"endpoint", "operation", "transports"}``. The operation line names the memory types
    (``... from host memory to cuda``)."""
    tables: list[dict[str, Any]] = []
    header: list[str] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        m = _TABLE_LINE.match(line)
        if not m:
            continue
        cells = [c.strip() for c in m.group(1).strip("|").split("|")]
        if len(cells) == 1:  # a title line: endpoint, then the operation
            if current is not None and current["transports"]:
                current = None
                header = []
            header.append(cells[0])
            if len(header) == 2:
                current = {"endpoint": header[0], "operation": header[1], "transports": []}
                tables.append(current)
            continue
        if current is not None and cells and cells[0] != "Range":
            for tl in _TL.findall(cells[-1]):
                if tl not in current["transports"]:
                    current["transports"].append(tl)
    return tables


def ucx_verdict(
    tables: list[dict[str, Any]], device: str, why: str = "no CUDA device"
) -> dict[str, Any]:
    """Which transports moved device memory (tables whose operation names ``cuda``), and the
    step's status: cuda_ipc / cuda_copy pass, a host-only path for device memory fails."""
    rma = [t for t in tables if "remote memory" in t["operation"]]
    cuda = [t for t in rma if "cuda" in t["operation"]]
    used = sorted({tl for t in rma for tl in t["transports"]})
    used_cuda = sorted({tl for t in cuda for tl in t["transports"]})
    details = {
        "tables": len(tables),
        "rma_transports": used,
        "cuda_transports": used_cuda,
        "cuda_operations": sorted({t["operation"] for t in cuda})[:12],
    }
    if not tables:
        return {"status": FAILED, "reason": "no UCX protocol table was logged", **details}
    if not device.startswith("cuda"):
        return {
            "status": NOT_APPLICABLE,
            "reason": f"not applicable: {why} "
            f"(host memory went over {', '.join(used) or 'nothing'})",
            **details,
        }
    if not cuda:
        return {"status": FAILED, "reason": "no protocol for cuda memory was selected", **details}
    if set(used_cuda) & CUDA_TLS:
        return {"status": PASSED, "reason": f"device memory over {', '.join(used_cuda)}", **details}
    return {
        "status": FAILED,
        "reason": f"device memory over {', '.join(used_cuda)} only: the host-memory fallback",
        **details,
    }


# -- the check --------------------------------------------------------------------------------


def _kit(runner: Runner, transport: str, caps: dict[str, list[str]] | None) -> dict[str, Any]:
    name = f"conformance_{transport}"
    kinds = (caps or {}).get(transport)
    if runner.device.startswith("cuda") and kinds is not None and "DEVICE" not in kinds:
        return _result(
            name,
            NOT_APPLICABLE,
            f"not applicable: kvframe-{transport}'s capability card claims {'/'.join(kinds)} "
            "memory only, so registering a CUDA tensor raises CapabilityError",
            memory_kinds=kinds,
        )
    need = [*KIT, *BINDINGS[transport]]
    binding = transport if BINDINGS[transport] else None
    missing = runner.missing(need, binding)
    if missing:
        return _missing_result(name, missing)
    with tempfile.TemporaryDirectory(prefix="kvframe-gpu-kit-") as tmp:
        xml = Path(tmp) / "kit.xml"
        # A library's deprecation notice on the GPU machine's newer packages must not turn
        # into a failure there (the project's pytest settings make warnings errors).
        argv = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=check_*.py",
                "-W", "ignore::DeprecationWarning", f"--junitxml={xml}",
                str(HERE / "check_conformance.py")]  # fmt: skip
        select = runner.sizes["kit_select"][transport]
        if select:
            argv += ["-k", select]
        t0 = time.monotonic()
        status, out = runner.child(
            argv,
            binding,
            {"KVFRAME_KIT_TRANSPORT": transport, "KVFRAME_KIT_DEVICE": runner.device},
        )
        counts = _junit_counts(xml)
    seconds = round(time.monotonic() - t0, 2)
    details = {"device": runner.device, "subset": select, **counts}
    if status != 0 or counts.get("tests", 0) == 0:
        return _result(
            name,
            FAILED,
            f"pytest exited with {status}",
            tail=out[-4000:],
            seconds=seconds,
            **details,
        )
    return _result(name, PASSED, seconds=seconds, **details)


def _junit_counts(xml: Path) -> dict[str, int]:
    if not xml.exists():
        return {}
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    return {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}


def _gpu_parts(result: dict[str, Any], cuda: bool, why: str) -> dict[str, Any]:
    """A step run on host memory in the dry run: its GPU claim is not applicable."""
    if cuda or result["status"] != PASSED:
        return result
    result["status"] = NOT_APPLICABLE
    result["reason"] = f"not applicable: {why}; the same code ran on host memory and passed"
    result["details"]["host_run"] = PASSED
    return result


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Run every step; returns the report (``{"mode", "device", "steps": [...], "ok"}``)."""
    mode = "dry-run" if args.dry_run else "gpu"
    deadline = time.monotonic() + args.deadline
    runner = Runner("cpu", SIZES["dry"], args.step_timeout, deadline)
    steps = _Steps(args.out)

    missing = runner.missing(BASE, None)
    env = (
        runner.step("environment", None) if not missing else _missing_result("environment", missing)
    )
    steps.append(env)
    has_cuda = bool(env["details"].get("cuda_available"))
    cuda = has_cuda and not args.dry_run
    why = "--dry-run" if has_cuda else "no CUDA device"
    if cuda:
        runner = Runner(args.device, SIZES["gpu"], args.step_timeout, deadline)
    caps = env["details"].get("transports")
    chosen = set(STEPS if args.only is None else args.only.split(","))

    missing = runner.missing([*BASE, "kvframe_nixl", "nixl_cu12"], "nixl")
    if "nixl_vram_registration" not in chosen:
        pass
    elif missing:
        steps.append(_missing_result("nixl_vram_registration", missing))
    else:
        steps.append(_gpu_parts(runner.step("nixl_vram_registration", "nixl"), cuda, why))

    for transport in BINDINGS:
        if f"conformance_{transport}" in chosen:
            steps.append(_gpu_parts(_kit(runner, transport, caps), cuda, why))

    if not chosen & {"transfer_vram", "ucx_transports"}:
        pass
    elif missing:
        steps.append(_missing_result("transfer_vram", missing))
        steps.append(_missing_result("ucx_transports", missing))
    else:
        with tempfile.TemporaryDirectory(prefix="kvframe-gpu-ucx-") as logs:
            ucx_env = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(Path(logs) / "ucx.%p.log")}
            result = runner.step("transfer", "nixl", ucx_env)
            result["name"] = "transfer_vram"
            steps.append(_gpu_parts(result, cuda, why))
            text = "".join(p.read_text(errors="replace") for p in sorted(Path(logs).glob("ucx.*")))
        verdict = ucx_verdict(parse_proto_tables(text), runner.device, why)
        status, reason = verdict.pop("status"), verdict.pop("reason")
        steps.append(_result("ucx_transports", status, reason, **verdict))

    missing = runner.missing(BASE, None)
    if "offload_cpu_tier" not in chosen:
        pass
    elif missing:
        steps.append(_missing_result("offload_cpu_tier", missing))
    else:
        result = runner.step("offload", None)
        result["name"] = "offload_cpu_tier"
        steps.append(_gpu_parts(result, cuda, why))

    bad = [s["name"] for s in steps if s["status"] in (FAILED, MISSING)]
    ok = not bad and (cuda or args.dry_run)
    report = {"mode": mode, "device": runner.device, "cuda": cuda, "steps": list(steps)}
    if args.only is not None:
        report["only"] = [name for name in STEPS if name in chosen]
    return {**report, "ok": ok, "bad": bad}


class _Steps(list[dict[str, Any]]):
    """The steps so far. Each one is announced on stderr as it ends and, with ``--out``, the
    report so far is written at once: a command stopped by its time limit still leaves them."""

    def __init__(self, out: str | None) -> None:
        super().__init__()
        self.out = out

    def append(self, step: dict[str, Any]) -> None:
        super().append(step)
        secs = step.get("seconds") or step["details"].get("seconds")
        took = f" [{secs:.1f} s]" if isinstance(secs, int | float) else ""
        print(
            f"gpu_check: {step['name']}: {step['status']} {step['reason']}{took}", file=sys.stderr
        )
        if self.out:
            partial = {"partial": True, "steps": list(self)}
            Path(self.out).write_text(json.dumps(partial, indent=2))


def format_report(report: dict[str, Any]) -> str:
    """The report for people: one line per step, then the transfer table and the figures."""
    lines = [f"kvframe GPU check ({report['mode']}, device {report['device']})", ""]
    for s in report["steps"]:
        secs = s.get("seconds") or s["details"].get("seconds")
        took = f" [{secs:.1f} s]" if isinstance(secs, int | float) else ""
        lines.append(f"{s['name']:<24} {s['status']:<15} {s['reason']}{took}")
    by_name = {s["name"]: s["details"] for s in report["steps"]}
    env = by_name.get("environment", {})
    if env.get("torch"):
        gpu = env.get("gpu", {}).get("name", "none")
        absent = [n for n, v in env.get("packages", {}).items() if v is None]
        lines += [
            "",
            f"python {env['python']}, torch {env['torch']} (CUDA {env['torch_cuda']}), GPU {gpu}",
            "packages missing: " + (", ".join(absent) or "none"),
            f"transports and their memory kinds: {env.get('transports')}",
        ]
    for key in (f"conformance_{t}" for t in BINDINGS):
        d = by_name.get(key, {})
        if "tests" in d:
            lines.append(
                f"{key}: {d['tests']} tests, {d['failures']} failed, {d['errors']} errors, "
                f"{d['skipped']} skipped, buffers on {d['device']}"
            )
    tr = by_name.get("transfer_vram", {})
    if tr.get("rows"):
        title = "VRAM->VRAM READ, GB/s" if report["cuda"] else "READ on host memory, GB/s (dry run)"
        lines += [
            "",
            title,
            "| block | blocks | pd_connector | kvframe | raw_nixl | pd/raw | kvframe/raw |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in tr["rows"]:
            lines.append(
                f"| {r['block_bytes'] >> 10} KiB | {r['blocks']} | {r['pd_connector_gbps']:.2f} | "
                f"{r['kvframe_gbps']:.2f} | {r['raw_nixl_gbps']:.2f} | "
                f"{r['pd_connector/raw_nixl']:.2f} | {r['kvframe/raw_nixl']:.2f} |"
            )
        v = tr["verify"]
        wrong = len(v["mismatches"])
        lines.append(f"byte checks: {v['transfers']} transfers, {v['bytes']} bytes, {wrong} wrong")
    ux = by_name.get("ucx_transports", {})
    if "rma_transports" in ux:
        lines.append(
            f"UCX transports: remote memory over {ux['rma_transports']}, "
            f"device memory over {ux['cuda_transports']}"
        )
    off = by_name.get("offload_cpu_tier", {})
    if "tier_store_gbps" in off:
        pinned = "pinned" if off["tier_pinned"] else "not pinned"
        lines += [
            "",
            f"cpu tier ({pinned}), {off['bytes'] >> 20} MiB: "
            f"store {off['tier_store_gbps']:.2f} GB/s (torch d2h {off['torch_d2h_gbps']:.2f}), "
            f"load {off['tier_load_gbps']:.2f} GB/s (torch h2d {off['torch_h2d_gbps']:.2f}); "
            f"{off['bytes_checked']} bytes checked",
        ]
    bad = ", ".join(report["bad"]) or "the GPU steps did not run"
    lines += ["", "result: " + ("ok" if report["ok"] else f"NOT ok ({bad})")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_step"] and len(argv) == 5:
        return run_body(argv[1], argv[2], argv[3], argv[4])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="GPU steps not applicable; host memory, small sizes"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device", default="cuda:0", help="the CUDA device (default cuda:0)")
    parser.add_argument("--step-timeout", type=float, default=240.0, help="seconds per step (240)")
    parser.add_argument(
        "--deadline", type=float, default=420.0, help="seconds for all steps together (420)"
    )
    parser.add_argument(
        "--only", help="run only these steps, comma-separated (a rerun); environment always runs"
    )
    parser.add_argument("--out", help="also write the JSON report to this file")
    args = parser.parse_args(argv)
    if not args.device.startswith("cuda"):
        parser.error(f"--device {args.device!r}: give a CUDA device such as cuda:0")
    unknown = set((args.only or "").split(",")) - set(STEPS) - {""}
    if unknown:
        parser.error(f"--only: unknown step(s) {sorted(unknown)}; steps: {', '.join(STEPS)}")
    report = check(args)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text if args.json else format_report(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
