"""The ``megaloop`` command runs end to end on the CPU reference."""

from __future__ import annotations

import subprocess
import sys

from megaloop.cli import main


def test_demo_runs_and_checks_itself(capsys) -> None:
    assert (
        main(
            [
                "demo",
                "--hidden",
                "64",
                "--heads",
                "4",
                "--kv-heads",
                "2",
                "--intermediate",
                "128",
                "--prompt",
                "5",
                "--decode",
                "3",
                "--vocab",
                "97",
                "--backend",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "decoded 3 tokens per sequence" in out and out.rstrip().endswith("OK")
    assert "CPU reference" in out


def test_ops_and_info(capsys) -> None:
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "attention" in out and "kv_cache_update" in out and "all_reduce" in out
    assert main(["info"]) == 0
    assert "ops registered" in capsys.readouterr().out


def test_console_entry_point_reports_errors_cleanly() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megaloop.cli", "demo", "--hidden", "30", "--heads", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "megaloop: GraphBuildError: LlamaConfig: hidden 30 is not divisible by heads 4" in proc.stderr
