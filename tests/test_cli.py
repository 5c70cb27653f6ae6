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


def test_generate_refuses_a_context_past_the_models_unless_asked(tmp_path, capsys) -> None:
    """--max-seq past max_position_embeddings (2048 in the tiny checkpoint) ran silently on main."""
    import json
    import warnings

    from megaloop.models import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path / "tiny")
    run = ["generate", "--model", str(folder), "--prompt", "Hi", "--backend", "cpu", "--max-new-tokens", "2",
           "--no-progress"]  # fmt: skip
    assert main([*run, "--max-seq", "4096"]) == 2
    err = capsys.readouterr().err
    assert "max_seq 4096 is past the model's context" in err and "= 2048" in err and "--allow-long-context" in err
    assert main([*run, "--max-seq", "4096", "--allow-long-context"]) == 0
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "exporter_note": "x"}))
    assert main(run) == 2 and "--allow-unknown-config-fields" in capsys.readouterr().err
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main([*run, "--allow-unknown-config-fields"]) == 0
    assert any("exporter_note" in str(w.message) for w in seen)
