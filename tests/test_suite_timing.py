"""The suite's own timer reads server starts from real vLLM log lines (tests/suite_timing.py)."""

from __future__ import annotations

from pathlib import Path

from tests.suite_timing import child_server_starts

# Lines as the CPU server writes them: stamped lines from its processes, the HTTP server's unstamped ones.
LOG = """$ python -m vllm.entrypoints.openai.api_server --model m
(APIServer pid=7) INFO 12-02 11:59:57 [api_utils.py:286] non-default args: {}
(EngineCore pid=8) INFO 12-02 12:01:01 [core.py:133] Initializing a V1 LLM engine
(APIServer pid=7) INFO 12-02 12:02:08 [entry.py:140] Starting vLLM server on http://127.0.0.2:40563
INFO:     Waiting for application startup.
INFO:     Application startup complete.
(APIServer pid=7) INFO 12-02 12:05:00 [launcher.py:279] [shutdown] API server: engine client stopped
(APIServer pid=9) INFO 12-02 12:06:00 [api_utils.py:286] non-default args: {}
(APIServer pid=9) INFO 12-02 12:06:40 [entry.py:140] Starting vLLM server on http://127.0.0.2:40563
INFO:     Application startup complete.
(APIServer pid=10) INFO 12-02 12:09:00 [api_utils.py:286] non-default args: {}
"""


def test_each_start_is_timed_from_its_first_line_to_ready(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "vllm_server.log").write_text(LOG)
    starts = child_server_starts(tmp_path)
    # Two starts reached ready (the restart's too); the third never did and is not counted.
    assert [s["seconds"] for s in starts] == [131.0, 40.0]
    assert {s["log"] for s in starts} == {"a/vllm_server.log"}
