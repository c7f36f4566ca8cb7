"""The GPU check's dry run, as CI runs it, and its verdicts on UCX's protocol tables.

``docs/gpu.md`` gives the dry-run command under a ``<!-- gpu-check: dry run -->`` marker; the
test runs exactly that command (with ``--json``) and checks the report: every GPU step is *not
applicable* and names the missing device, while the same code moved and checked bytes on host
memory. The UCX verdict is checked on protocol tables in UCX's own format (one from this
machine's host-memory run, and device-memory ones written as UCX prints them), so the GPU-only
judgement (``cuda_ipc`` passes, a shared-memory fallback fails) is tested without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import gpu_check  # noqa: E402  (a script beside this file, not a package)

GPU_STEPS = (
    "nixl_vram_registration",
    "conformance_inprocess",
    "conformance_nixl",
    "conformance_ucx",
    "transfer_vram",
    "offload_cpu_tier",
)


def _docs_command(marker: str) -> list[str]:
    text = (ROOT / "docs" / "gpu.md").read_text()
    m = re.search(rf"<!-- gpu-check: {marker} -->\n```bash\n(.*?)\n```", text, re.S)
    assert m, f"docs/gpu.md lacks the '{marker}' command block"
    return shlex.split(m.group(1))


@pytest.fixture(scope="module")
def dry_run() -> dict[str, Any]:
    if importlib.util.find_spec("nixl_cu12") is None or importlib.util.find_spec("ucxx") is None:
        pytest.skip("the dry run needs nixl-cu12 and ucxx-cu12 (./dev installs both)")
    argv = _docs_command("dry run")
    assert argv[:2] == ["python", "tests/gpu/gpu_check.py"], argv
    proc = subprocess.run(
        [sys.executable, *argv[1:], "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.mark.nixl
@pytest.mark.ucx
def test_dry_run_reports_every_gpu_step_not_applicable(dry_run: dict[str, Any]) -> None:
    assert dry_run["mode"] == "dry-run"
    assert dry_run["ok"] is True
    assert dry_run["bad"] == []
    steps = {s["name"]: s for s in dry_run["steps"]}
    assert list(steps) == ["environment", *GPU_STEPS[:5], "ucx_transports", GPU_STEPS[5]]
    assert steps["environment"]["status"] == "passed"
    cuda = steps["environment"]["details"]["cuda_available"]
    why = "--dry-run" if cuda else "no CUDA device"
    for name in (*GPU_STEPS, "ucx_transports"):
        step = steps[name]
        assert step["status"] == "not applicable", step
        assert step["reason"].startswith(f"not applicable: {why}"), step["reason"]
    for name in GPU_STEPS:
        assert steps[name]["details"]["host_run"] == "passed", steps[name]


@pytest.mark.nixl
@pytest.mark.ucx
def test_dry_run_moved_and_checked_bytes_on_host_memory(dry_run: dict[str, Any]) -> None:
    steps = {s["name"]: s["details"] for s in dry_run["steps"]}
    assert steps["nixl_vram_registration"]["nixl_memory"] == "DRAM"
    for kit in ("conformance_inprocess", "conformance_nixl", "conformance_ucx"):
        d = steps[kit]
        assert d["device"] == "cpu"
        assert d["tests"] >= 1
        assert d["failures"] == d["errors"] == 0, d
    assert steps["conformance_inprocess"]["tests"] >= 20  # the whole kit
    transfer = steps["transfer_vram"]
    sizes = gpu_check.SIZES["dry"]["transfer"]
    cells = [(r["block_bytes"], r["blocks"]) for r in transfer["rows"]]
    assert cells == [(b, n) for b in sizes["block_sizes"] for n in sizes["blocks"]]
    for row in transfer["rows"]:
        assert row["pd_connector/raw_nixl"] > 0
        assert row["kvframe/raw_nixl"] > 0
    verify = transfer["verify"]
    methods = 6  # kvframe, kvframe_inline, raw_nixl, memcpy, pd_connector, pd_floor
    assert verify["transfers"] == len(cells) * methods * (sizes["repeats"] + 1)
    assert verify["bytes"] == methods * (sizes["repeats"] + 1) * sum(b * n for b, n in cells)
    assert verify["mismatches"] == []
    ucx = steps["ucx_transports"]
    assert ucx["tables"] > 0
    assert ucx["rma_transports"], "host-memory READs went over no logged UCX transport"
    assert ucx["cuda_transports"] == []
    offload = steps["offload_cpu_tier"]
    assert offload["tier_pinned"] is False
    assert offload["bytes_checked"] >= 2 * offload["bytes"]
    text = gpu_check.format_report(dry_run)
    assert "result: ok" in text
    assert "byte checks:" in text


@pytest.mark.parametrize("argv", [["--device", "cpu"], ["--only", "transfer_vram,no_such_step"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv)
    assert exc.value.code == 2


def test_only_runs_the_steps_named(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    code = gpu_check.main(["--dry-run", "--only", "offload_cpu_tier", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0
    assert report["only"] == ["offload_cpu_tier"]
    assert [s["name"] for s in report["steps"]] == ["environment", "offload_cpu_tier"]


# -- UCX's protocol tables ----------------------------------------------------------------------


def _table(endpoint: str, operation: str, rows: list[tuple[str, str, str]]) -> str:
    """A table as UCX 1.21 logs it with UCX_PROTO_INFO=y (format copied from a host run)."""
    prefix = "[1796131379.355404] [vm:28117:0]   "
    lines = [
        "+--------+-------------+---------------+",
        f"| {endpoint} |",
        f"| {operation} |",
        "+--------+-------------+---------------+",
        "| Range  | Description |    Config     |",
        "+--------+-------------+---------------+",
        *(f"| {a} | {b} | {c} |" for a, b, c in rows),
        "+--------+-------------+---------------+",
    ]
    return "\n".join(prefix + line for line in lines) + "\n"


HOST_READ = _table(
    "bench-D-kvframe-28117 intra-node cfg#1",
    "remote memory read by ucp_get*(multi) into host memory from host",
    [("0..inf", "zero-copy", "cma/memory")],
)
HOST_AM = _table(
    "bench-D-kvframe-28117 self cfg#0",
    "active message by ucp_am_send* from host memory",
    [("0", "short", "tcp/lo"), ("1..16515", "zero-copy", "tcp/lo")],
)


def _cuda_read(config: str) -> str:
    return _table(
        "bench-D-raw-1 intra-node cfg#2",
        "remote memory read by ucp_get*(multi) into cuda memory from cuda",
        [("0..inf", "zero-copy", config)],
    )


def test_proto_tables_are_parsed_per_table() -> None:
    tables = gpu_check.parse_proto_tables("noise\n" + HOST_READ + HOST_AM)
    assert tables == [
        {
            "endpoint": "bench-D-kvframe-28117 intra-node cfg#1",
            "operation": "remote memory read by ucp_get*(multi) into host memory from host",
            "transports": ["cma"],
        },
        {
            "endpoint": "bench-D-kvframe-28117 self cfg#0",
            "operation": "active message by ucp_am_send* from host memory",
            "transports": ["tcp"],
        },
    ]


def test_device_memory_over_cuda_ipc_passes() -> None:
    tables = gpu_check.parse_proto_tables(HOST_AM + _cuda_read("cuda_ipc/cuda"))
    verdict = gpu_check.ucx_verdict(tables, "cuda:0")
    assert verdict["status"] == "passed", verdict
    assert verdict["cuda_transports"] == ["cuda_ipc"]


@pytest.mark.parametrize("config", ["sysv/memory", "posix/memory", "cma/memory", "tcp/lo"])
def test_device_memory_over_a_host_transport_is_the_fallback_and_fails(config: str) -> None:
    tables = gpu_check.parse_proto_tables(_cuda_read(config))
    verdict = gpu_check.ucx_verdict(tables, "cuda:0")
    assert verdict["status"] == "failed"
    assert "fallback" in verdict["reason"]


def test_no_cuda_table_on_a_gpu_run_fails_and_none_at_all_fails() -> None:
    host_only = gpu_check.parse_proto_tables(HOST_READ)
    assert gpu_check.ucx_verdict(host_only, "cuda:0")["status"] == "failed"
    assert gpu_check.ucx_verdict([], "cpu")["status"] == "failed"
    dry = gpu_check.ucx_verdict(host_only, "cpu")
    assert dry["status"] == "not applicable"
    assert dry["reason"] == "not applicable: no CUDA device (host memory went over cma)"


def test_the_device_command_in_the_docs_runs_run_sh_with_the_carried_wheels() -> None:
    run = _docs_command("on the GPU machine")
    assert run[:2] == ["bash", "tests/gpu/run.sh"], run
    subprocess.run(["bash", "-n", str(HERE / "run.sh")], check=True)
    text = (ROOT / "docs" / "gpu.md").read_text()
    for group in ("common", "nixl"):
        assert f".kvframe-gpu-wheels/{group}" in text


def test_a_missing_package_is_named_with_its_distribution() -> None:
    runner = gpu_check.Runner("cpu", gpu_check.SIZES["dry"], timeout=60)
    assert runner.missing(["json", "kvframe_no_such_module"], None) == ["kvframe_no_such_module"]
    result = gpu_check._missing_result("transfer_vram", ["nixl_cu12", "zmq"])
    assert result["status"] == "missing"
    assert "nixl_cu12 (pip: nixl-cu12)" in result["reason"]
    assert "zmq (pip: pyzmq)" in result["reason"]
    assert "prepare_carry.py" in result["reason"]
