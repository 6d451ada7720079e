"""The metrics' label values stay a bounded set."""

from __future__ import annotations


def test_error_code_labels_are_bounded(monkeypatch) -> None:  # noqa: ANN001
    """A relayed backend code (or the simulator's ``fail:CODE``) is a label value: past
    MAX_ERROR_CODES distinct ones a new code counts as "other", the known ones as themselves."""
    from hotloop.server import metrics

    monkeypatch.setattr(metrics, "_codes", set())
    assert [metrics._bounded_code(f"code_{i}") for i in range(metrics.MAX_ERROR_CODES)] == [
        f"code_{i}" for i in range(metrics.MAX_ERROR_CODES)
    ]
    assert metrics._bounded_code("one_more") == metrics.OTHER
    assert metrics._bounded_code("code_7") == "code_7"
    assert metrics._bounded_code("bad code!") == metrics.OTHER
    assert metrics._bounded_code("rate_limit_exceeded") == "rate_limit_exceeded"  # the server's own: always
