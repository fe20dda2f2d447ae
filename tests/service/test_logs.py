"""`tandem service logs`: the last lines, then what is appended, across a log rotation."""

from __future__ import annotations

import io
import threading
import time

from app.service.control import follow_file


def test_tail_then_follow_across_a_rotation(tmp_path):
    log = tmp_path / "tandem.log"
    log.write_text("".join(f"old {i}\n" for i in range(10)))
    out, stop = io.StringIO(), threading.Event()
    follower = threading.Thread(target=follow_file, args=(log,),
                                kwargs={"lines": 3, "follow": True, "out": out, "poll_s": 0.02, "stop": stop})
    follower.start()

    def wait_for(text: str) -> None:
        deadline = time.monotonic() + 5
        while text not in out.getvalue():
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.01)

    try:
        wait_for("old 9\n")
        with open(log, "a") as f:
            f.write("appended\n")
        wait_for("appended\n")
        log.rename(tmp_path / "tandem.log.1")  # rotated away, a new file in its place
        log.write_text("after rotation\n")
        wait_for("after rotation\n")
    finally:
        stop.set()
        follower.join(timeout=5)
    assert out.getvalue() == "old 7\nold 8\nold 9\nappended\nafter rotation\n"


def test_no_follow_prints_the_tail_and_returns(tmp_path):
    log = tmp_path / "tandem.log"
    log.write_text("a\nb\nc\n")
    out = io.StringIO()
    follow_file(log, lines=2, follow=False, out=out)
    assert out.getvalue() == "b\nc\n"
