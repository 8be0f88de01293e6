"""A user's browser for the tests of the MLflow UI: Debian's headless ``chromium``, each browser with a fresh profile
(no setting the UI keeps in the browser, such as its GenAI / model training switch, carries over from another
test or from a page checked in another browser; the pages given one :class:`Tab` share it), driven in real time
over the DevTools protocol on a pipe, without any Python package (:class:`Tab`): a page's text once what the test
expects has appeared (:func:`page_lines`; the single-page app renders after its load, its metric charts later
still, one request per metric), and a screenshot of a run's charts (:func:`screenshot`).

``python -m tests.browser URL OUT.png`` takes the screenshot of ``docs/metrics.md`` (``URL``: a run's Model metrics
page; the test that takes one too: ``tests/integration/cli/test_help.py``).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

FLAGS = [
    "--headless",
    "--no-sandbox",  # root in containers
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
SHOT = (1400, 2400)
"""The window of a screenshot: tall, so that the charts below the first row are drawn (they render when visible)."""
CROP = (0, 0, 1035, 1150)
"""The part of a screenshot in the docs: the side bar and the page, the assistant panel and the lower charts left
out (pixels of a :data:`SHOT` window)."""


def chromium() -> str | None:
    return shutil.which("chromium")


def require_chromium() -> str:
    """Chromium's path; without it the test is skipped, except under CI (``CI`` set), where it fails: ``.ci/run``
    installs it."""
    found = chromium()
    if found:
        return found
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail("chromium is missing under CI: .ci/run installs it (apt-get install chromium)")
    pytest.skip("chromium is not installed (apt-get install --no-install-recommends chromium): no browser check")


class Tab:
    """One Chromium page driven in real time over the DevTools protocol on a pipe (``--remote-debugging-pipe``:
    JSON messages ended by NUL on file descriptors 3 and 4, no WebSocket client needed). Chromium's own
    ``--virtual-time-budget`` with ``--dump-dom`` / ``--screenshot`` does not wait for content that arrives after
    the page's load: it left the charts as spinners."""

    def __init__(self, width: int, height: int):
        binary = require_chromium()
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-")
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()

        def fds() -> None:  # the child's fds 3 (commands in) and 4 (replies out), copied from above 10 first
            a, b = fcntl.fcntl(to_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [*FLAGS, f"--user-data-dir={self._profile.name}", f"--window-size={width},{height}"]
        self.proc = subprocess.Popen(
            [binary, *args, "--remote-debugging-pipe", "about:blank"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=fds,
            pass_fds=(3, 4),
            start_new_session=True,
        )
        os.close(to_r)
        os.close(from_w)
        self._buf, self._id = b"", 0
        target = self._call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self._call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _call(self, method: str, params: dict | None = None, session: bool = False, timeout: float = 60) -> dict:
        self._id += 1
        msg: dict = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self._session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:  # events and other replies are passed over
            while b"\0" not in self._buf:
                assert time.monotonic() < deadline, f"chromium did not answer {method} in {timeout:.0f} s"
                ready, _, _ = select.select([self._from], [], [], 1.0)
                if ready:
                    chunk = os.read(self._from, 1 << 20)
                    assert chunk, f"chromium closed its pipe (exit {self.proc.poll()}) during {method}"
                    self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply.get("result", {})

    def open(self, url: str) -> None:
        self._call("Page.navigate", {"url": url}, session=True)

    def eval(self, expression: str):
        return self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=True)[
            "result"
        ].get("value")

    def wait_for(self, expression: str, timeout: float = 120) -> None:
        """Until ``expression`` (JavaScript) is true in the page, in real time."""
        deadline = time.monotonic() + timeout
        while not self.eval(expression):
            assert time.monotonic() < deadline, f"the page never got {expression} in {timeout:.0f} s"
            time.sleep(0.5)

    def png(self) -> bytes:
        return base64.b64decode(self._call("Page.captureScreenshot", {"format": "png"}, session=True)["data"])

    def __enter__(self) -> Tab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._call("Browser.close", timeout=10)
            self.proc.wait(timeout=10)
        except (AssertionError, OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        finally:
            os.close(self._to)
            os.close(self._from)
            self._profile.cleanup()


def page_lines(url: str, expect: tuple[str, ...], timeout: float = 120, tab: Tab | None = None) -> list[str]:
    """The page's text as a user reads it (``innerText``, one entry per line) once every line of ``expect`` is
    there, or at ``timeout`` without them (the caller names what is missing). In ``tab`` when given (the page is
    loaded anew there, after a blank page, with the profile's cache and storage: a user's next link), else in a
    browser of its own with a fresh profile."""
    with _tab(tab, 1400, 1000) as t:
        t.open(url)
        deadline = time.monotonic() + timeout
        while True:
            lines = [line.strip() for line in (t.eval("document.body.innerText") or "").splitlines()]
            if all(e in lines for e in expect) or time.monotonic() > deadline:
                return [line for line in lines if line]
            time.sleep(0.5)


@contextlib.contextmanager
def _tab(tab: Tab | None, width: int, height: int) -> Iterator[Tab]:
    """``tab`` emptied (``about:blank``, so nothing of its last page is read as the next one's), or a new one,
    closed after the block."""
    if tab is not None:
        tab.open("about:blank")
        yield tab
        return
    own = Tab(width, height)
    try:
        yield own
    finally:
        own.close()


CHARTS_DRAWN = (
    "[...document.querySelectorAll('svg.main-svg')].filter(s => "
    "{const r = s.getBoundingClientRect(); return r.top >= 0 && r.bottom <= innerHeight}).length >= 6"
)
"""Two rows of metric charts in view are drawn (Plotly's SVGs; a chart is drawn once it comes into view)."""


def screenshot(url: str, out: Path, section: str = "train", timeout: float = 180, tab: Tab | None = None) -> Path:
    """A PNG of a run's Model metrics page scrolled to the charts of ``section`` (the metrics named
    ``SECTION/...``) once they are drawn, cropped to :data:`CROP`; in ``tab`` when given (a :data:`SHOT`
    window), else in a browser of its own."""
    from PIL import Image

    heading = (  # the section's header: its name, then the number of its charts
        "[...document.querySelectorAll('[data-testid=experiment-view-compare-runs-section-header]')]"
        f".find(h => h.textContent.startsWith('{section}('))"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    with _tab(tab, *SHOT) as t:
        t.open(url)
        t.wait_for(f"{CHARTS_DRAWN} && {heading} !== undefined", timeout)
        t.eval(f"{heading}.scrollIntoView({{block: 'start'}})")
        t.wait_for(CHARTS_DRAWN, timeout)  # the section's charts, drawn once in view
        time.sleep(1.0)  # the last chart's paint
        data = t.png()
    with Image.open(io.BytesIO(data)) as image:
        image.crop(CROP).save(out, optimize=True)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.browser URL OUT.png")
    print(screenshot(sys.argv[1], Path(sys.argv[2])))
