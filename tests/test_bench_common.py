"""The benchmark scripts' shared scaffolding (benchmarks/bench_common.py): its pure parts.

Every benchmark report is built from these (the machine line, Markdown tables and ratio cells,
comma-separated arguments), so they are checked here without a server, a network or a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_common as bc  # noqa: E402

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 106
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
stepping\t: 6

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz
"""
LSCPU = """Architecture:             x86_64
  CPU op-mode(s):         32-bit, 64-bit
Vendor ID:                AuthenticAMD
  Model name:             AMD EPYC 7R13 Processor
    CPU family:           25
"""
ARM_CPUINFO = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"


# -- the machine line --------------------------------------------------------------------------
def test_cpu_model_from_cpuinfo_and_lscpu():
    assert bc.parse_cpu_model(CPUINFO) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    assert bc.parse_cpu_model(LSCPU) == "AMD EPYC 7R13 Processor"
    # "model" alone (a number in cpuinfo) and an empty value are no model name
    assert bc.parse_cpu_model("model\t\t: 106\nmodel name\t:   \n") is None
    assert bc.parse_cpu_model(ARM_CPUINFO) is None
    assert bc.parse_cpu_model("") is None


def test_cpu_model_falls_back_when_the_file_names_none(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(CPUINFO)
    assert bc.cpu_model(info) == "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
    info.write_text(ARM_CPUINFO)
    assert bc.cpu_model(info)  # platform's answer (or "unknown cpu"), never empty
    assert bc.cpu_model(tmp_path / "missing")


def test_machine_line_joins_cpu_cores_and_details():
    assert bc.machine_line(cpu="Xeon", cores=2) == "Xeon, 2 cores"
    assert bc.machine_line("torch threads 1", "torch 2.5", cpu="Xeon", cores=16) == \
        "Xeon, 16 cores, torch threads 1, torch 2.5"
    line = bc.machine_line("1-min load average 0.50 at the end", cores_note="(client and server on the same machine)",
                           cpu="EPYC", cores=4)
    assert line == "EPYC, 4 cores (client and server on the same machine), 1-min load average 0.50 at the end"
    assert bc.machine_line().endswith(f", {os.cpu_count()} cores")


def test_load_line_flags_a_busy_machine():
    assert bc.load_line(0.5, cores=2) == "1-min load average 0.50 at the end"
    assert bc.load_line(1.25, start=0.75, cores=2) == "1-min load average 0.75 at the start, 1.25 at the end"
    assert bc.load_line(3.0, cores=2) == f"1-min load average 3.00 at the end ({bc.BUSY_NOTE})"
    # busy at the start counts too; the hint says what to do about it
    assert bc.load_line(0.1, start=5.0, hint="--threads 1 suffers least", cores=4) == (
        "1-min load average 5.00 at the start, 0.10 at the end "
        f"({bc.BUSY_NOTE}; --threads 1 suffers least)")
    assert bc.is_busy(2.01, 2) and not bc.is_busy(2.0, 2)
    assert bc.load_line().startswith("1-min load average ")  # the load now
    assert len(bc.load_averages().split("/")) == 3


# -- tables --------------------------------------------------------------------------------------
def test_ratio_cells():
    assert bc.ratio(530.0, 170.0) == "3.12x"
    assert bc.ratio(1, 3, digits=3) == "0.333x"
    assert bc.ratio(0.0, 2.0) == "0.00x"
    assert bc.ratio(None, 2.0) == "n/a" and bc.ratio(2.0, None) == "n/a" and bc.ratio(2.0, 0.0) == "n/a"
    assert bc.ratio(None, 1.0, missing="n.a.") == "n.a."


def test_fmt_value():
    assert bc.fmt_value(1234.56) == "1235"
    assert bc.fmt_value(0.8234, "{:.0%}") == "82%"
    assert bc.fmt_value(None) == "n/a" and bc.fmt_value(None, missing="-") == "-"


def test_markdown_table_rows_rule_and_alignment():
    lines = bc.md_table(["batch", "ours tok/s", "identical ids"], [[1, "170 (168)", "yes"], [8, "900", "NO"]], "rrl")
    assert lines == [
        "| batch | ours tok/s | identical ids |",
        "|---:|---:|---|",
        "| 1 | 170 (168) | yes |",
        "| 8 | 900 | NO |",
    ]
    assert bc.md_table(["a", "b"]) == ["| a | b |", "|---|---|"]  # left-aligned by default, no rows
    assert bc.md_rule("lrc") == "|---|---:|:---:|"
    assert bc.md_row(["x", "", 3]) == "| x |  | 3 |"


def test_markdown_table_refuses_a_missing_column():
    with pytest.raises(ValueError, match="a row has 2 cells, the header 3"):
        bc.md_table(["a", "b", "c"], [["1", "2"]])
    with pytest.raises(ValueError, match="3 columns but 2 alignments"):
        bc.md_table(["a", "b", "c"], [], "rr")
    with pytest.raises(ValueError, match="l, r or c"):
        bc.md_rule("lx")


# -- arguments, command line, statistics -----------------------------------------------------------
def test_parse_ints():
    assert bc.parse_ints("1,8, 32,", "--concurrency") == [1, 8, 32]
    with pytest.raises(ValueError, match="--batch-sizes must be a comma-separated list of integers"):
        bc.parse_ints("1,x", "--batch-sizes")
    with pytest.raises(ValueError, match="--concurrency needs integers >= 1"):
        bc.parse_ints("0,4", "--concurrency")
    with pytest.raises(ValueError, match="needs integers >= 1"):
        bc.parse_ints(" , ", "--batches")


def test_command_line_quotes_arguments():
    argv = ["benchmarks/serve_load.py", "--server-args", "--dtype float32"]
    assert bc.command_line(argv=argv) == "python benchmarks/serve_load.py --server-args '--dtype float32'"
    assert bc.command_line("python3", script="benchmarks/kernels_cpu.py", argv=["/abs/kernels_cpu.py", "--quick"]) \
        == "python3 benchmarks/kernels_cpu.py --quick"


def test_pct_and_streamed_reply():
    assert bc.pct([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert bc.pct([], 90) != bc.pct([], 90)  # NaN for no values
    reply = bc.StreamedReply(sent=1.0, stamps=[1.25, 1.5, 1.75])
    assert reply.tokens == 3 and reply.ttft == pytest.approx(0.25) and reply.error is None and reply.text == ""


def test_steps_delta_counts_new_histograms_from_zero():
    before = {bc.STEP: (1.0, 10.0)}
    after = {bc.STEP: (3.0, 30.0), f"{bc.FORWARD}/prefill": (0.5, 2.0)}
    assert bc.steps_delta(before, after) == {bc.STEP: (2.0, 20.0), f"{bc.FORWARD}/prefill": (0.5, 2.0)}


def test_free_ports_are_bindable():
    import socket

    port = bc.free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_openmp_as_serve_gives_the_ranks_waits_unless_the_user_chose(monkeypatch):
    """In-process steps are measured with the OpenMP waits `serve` gives its ranks (passive), never
    over a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert bc.openmp_as_serve() == {"OMP_WAIT_POLICY": "passive"}
    assert os.environ["OMP_WAIT_POLICY"] == "passive"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert bc.openmp_as_serve() == {} and os.environ["OMP_WAIT_POLICY"] == "active"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert bc.openmp_as_serve() == {} and "OMP_WAIT_POLICY" not in os.environ
