"""The engine worker's CPU per page: on a big GPU the client has to keep up with 20+ pages/s,
so work that cannot change a page's result is not done."""

from __future__ import annotations

from ocrvl_daemon.config.model import Config
from ocrvl_daemon.engine.worker_settings import pipeline_kwargs


def test_without_layout_detection_paddlex_does_not_merge_the_one_block_of_each_page() -> None:
    whole_page = Config.model_validate({"pipeline": {"use_layout_detection": False}})
    assert pipeline_kwargs(whole_page, "http://x/v1")["merge_layout_blocks"] is False, (
        "with the page as its only block, merging copies the page image for nothing")
    with_layout = Config.model_validate({"pipeline": {"use_layout_detection": True}})
    assert "merge_layout_blocks" not in pipeline_kwargs(with_layout, "http://x/v1"), (
        "with layout detection, PaddleX's own merging of adjacent blocks must stay")
