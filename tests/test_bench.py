"""pipeline.tools.bench end to end on stories260K: with ``--launch single --hf-generate`` every pipeline mode keeps
its Gantt chart (hf_generate runs outside the pipeline and is no mode of the trace) and the summary names the head."""
from __future__ import annotations

import pytest

from tests.helpers import STORIES


@pytest.mark.skipif(not STORIES.is_dir(), reason="../shared is not available")
def test_single_launch_with_hf_generate_keeps_every_gantt(tmp_path, capsys):
    """One prompt, two pipeline modes: the trace holds 2 generations. Counting hf_generate as a third mode of the
    trace (the bug) gave each mode 2 // 3 = 0 of them, and no Gantt chart."""
    from model.split import split_checkpoint
    from pipeline.tools.bench import main
    stages = split_checkpoint(STORIES, tmp_path / "stages", [0, 3, 2], progress=False)
    out = tmp_path / "bench"
    code = main(["--launch", "single", "--hf-generate", "--modes", "ar,naive", "--prompt-ids", "1,5,9,13",
                 "--warmup", "0", "--out-dir", str(out), "--quiet", "max_new_tokens=8",
                 f"model.stage_dir={stages}", f"model.head_dir=oracle:{STORIES}"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert (out / "gantt_ar.png").is_file() and (out / "gantt_naive.png").is_file()
    assert not (out / "gantt_hf_generate.png").exists()
    summary = (out / "summary.md").read_text()
    assert "hf_generate" in summary and "draft head: oracle:" in summary
