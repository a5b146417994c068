"""``tessera-ray size``: exact JSON, the human table, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tessera_ray.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["size", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_exact_mha_and_mla_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "deepseek-v3", "--context", "128k", "--json")
    assert code == 0
    assert "523986010112" in out and "9210691584" in out
    (model,) = json.loads(out)["models"]
    (ctx,) = model["contexts"]
    assert ctx["mha_bytes"] == 523_986_010_112
    assert ctx["payload_bytes"] == 9_210_691_584
    assert ctx["ratio"] == "512/9"
    assert (model["block_tokens"], ctx["blocks"], ctx["pages"]) == (64, 2048, 2048 * 61)


def test_table_shows_gib(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "deepseek-v3", "--context", "8k,32k,128k,512k,1m")
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("128k"))
    assert "488.0 GiB" in row and "8.578 GiB" in row and "56.89x" in row


def test_several_models_and_formats(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        capsys, "--model", "deepseek-v4-flash", "--format", "v4-paper", "--context", "1m", "--json"
    )
    assert code == 0
    (model,) = json.loads(out)["models"]
    specs = {s["spec"].split(":")[0]: s for s in model["specs"]}
    assert specs["hca"]["bytes_per_token"] == "9/2"
    assert specs["csa"]["bytes_per_token"] == "160"
    assert specs["swa"]["window_tokens"] == 128


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--list")
    assert code == 0
    for name in ("deepseek-v4-pro", "kimi-k2", "fp8_ds_mla", "v4-model1", "kv-fp8"):
        assert name in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'; valid: deepseek-v3"),
        (["--context", "0"], "context '0' must be a positive"),
        (["--context", "-4k"], "context '-4k' must be a positive"),
        (["--context", "12q"], "cannot parse context '12q'"),
        (["--format", "fp3"], "unknown format 'fp3'"),
        (
            ["--model", "deepseek-v4-flash", "--block-tokens", "64"],
            "would split the hca compression group",
        ),
        (["--block-tokens", "-8"], "--block-tokens must be a positive integer, got -8"),
        (["--block-tokens", "x"], "invalid int value: 'x'"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tessera_ray.cli", "size", *args], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_custom_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "mine.json"
    good.write_text(
        json.dumps(
            {
                "family": "mla",
                "name": "mine",
                "num_layers": 2,
                "num_heads": 4,
                "format": "fp8_ds_mla",
            }
        )
    )
    code, out, _ = run(capsys, "--config", str(good), "--context", "64", "--json")
    assert code == 0
    assert json.loads(out)["models"][0]["contexts"][0]["payload_bytes"] == 64 * 2 * 656
    split = tmp_path / "split.json"
    split.write_text(
        json.dumps(
            {"family": "v4", "num_heads": 8, "compress_ratios": [0, 4, 128], "block_tokens": 64}
        )
    )
    code, _, err = run(capsys, "--config", str(split))
    assert code == 2 and "would split the hca compression group of 128 tokens" in err
    negative = tmp_path / "neg.json"
    negative.write_text(
        json.dumps(
            {
                "family": "full-kv",
                "num_layers": 4,
                "num_heads": 8,
                "num_kv_heads": 8,
                "head_dim": -64,
            }
        )
    )
    code, _, err = run(capsys, "--config", str(negative))
    assert code == 2 and "head_dim must be a positive integer, got -64" in err


def test_plot_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_png = tmp_path / "sizes.png"
    code, out, _ = run(capsys, "--plot", str(out_png), "--context", "8k")
    assert code == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "deepseek-v4-flash" in out and "llama-3.1-70b" in out


def test_plot_without_the_plot_extra_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, _, err = run(capsys, "--plot", str(tmp_path / "sizes.png"), "--context", "8k")
    assert code == 2
    assert "tessera-ray[plot]" in err and not (tmp_path / "sizes.png").exists()
