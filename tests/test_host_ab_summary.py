"""benchmarks/host_ab_summary.py on a made-up log of two rounds (no GPU needed)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_ab_summary  # noqa: E402

HOST_TABLE = """| op | B | L | T | mode | call us | host us (GPU busy) | GPU still busy |
|---|---|---|---|---|---|---|---|
| viterbi | 1 | 128 | 9 | checked | 140.0 | 2100.0 | no |
| viterbi | 1 | 128 | 9 | deferred | {call} | {host} | yes |
"""
PIECES = """| shape | piece | host us | GPU still busy |
|---|---|---|---|
| 1x128x9 | op viterbi | {piece} | yes |
"""


def log(rounds):
    lines = []
    for number, (old, new) in enumerate(rounds, 1):
        for side, (call, host, piece) in (("old", old), ("new", new)):
            lines.append(f"== round {number}, {side} (/tree)")
            table = HOST_TABLE.format(call=call, host=host)
            lines += [table, table]  # profile_gpu_host.py prints its table twice
            lines.append(PIECES.format(piece=piece))
    return "\n".join(lines)


def test_medians_per_side_and_ratio():
    text = log([((100.0, 60.0, 50.0), (90.0, 30.0, 20.0)), ((110.0, 80.0, 70.0), (80.0, 40.0, 30.0))])
    figures = host_ab_summary.parse(text)
    assert figures[("host", "viterbi (1, 128, 9)")] == {"old": [60.0, 80.0], "new": [30.0, 40.0]}
    assert figures[("call", "viterbi (1, 128, 9)")]["new"] == [90.0, 80.0]
    assert figures[("piece", "1x128x9: op viterbi")]["old"] == [50.0, 70.0]
    assert not any(key[1].startswith("viterbi") and "checked" in key[1] for key in figures)
    tables = host_ab_summary.tables(figures)
    assert "| viterbi (1, 128, 9) | 60.0, 80.0 | 30.0, 40.0 | 70.0 | 35.0 | 0.50 |" in tables
    assert "| 1x128x9: op viterbi | 50.0, 70.0 | 20.0, 30.0 | 60.0 | 25.0 | 0.42 |" in tables


def test_main_writes_title_about_and_tables(tmp_path):
    source = tmp_path / "host_ab.log"
    source.write_text(log([((100.0, 60.0, 50.0), (90.0, 30.0, 20.0))]))
    out = tmp_path / "summary.md"
    assert host_ab_summary.main([str(source), "--title", "T", "--about", "command: x", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# T\n\n- command: x\n\n### Host us per call")
    assert "| viterbi (1, 128, 9) | 60.0 | 30.0 | 60.0 | 30.0 | 0.50 |" in text
