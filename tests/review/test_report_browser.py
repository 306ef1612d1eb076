"""The report opened in a real browser: headless Chromium (the Debian ``chromium`` package) driven by
Playwright for Python, with every network request blocked. No console errors, no failed or
attempted network requests, one DAG node per step, a click on a node shows that step's section, and
the page is not blank. Skipped, with the reason, where Chromium or Playwright is not installed.

``MARIN_REPORT_SCREENSHOT=docs/images/report.png`` also saves the screenshot the user guide shows.
"""

from __future__ import annotations

import os
import shutil

import pytest

import marin.review as mr
from marin.review.report import write_report

CHROMIUM = os.environ.get("MARIN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _launch(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])


@pytest.fixture(scope="module")
def playwright():
    if not CHROMIUM:
        pytest.skip("no chromium binary (Debian: apt-get install chromium; or set MARIN_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install '.[test]')")
    with sync_api.sync_playwright() as p:
        yield p


def test_report_in_headless_chromium(playwright, small_experiment, tmp_path):
    prefix, built = small_experiment
    exp = mr.load(prefix=prefix)
    path = write_report(exp, str(tmp_path / "report.html"))
    browser = _launch(playwright)
    try:
        # bypass_csp: the report's own Content-Security-Policy would block requests before the router
        # sees them; without it, any request the page attempts reaches the router and fails the test
        page = browser.new_page(viewport={"width": 1280, "height": 900}, bypass_csp=True)
        attempted, failed, console_errors = [], [], []

        def route(r):
            if r.request.url.startswith("file://"):
                r.continue_()
            else:
                attempted.append(r.request.url)
                r.abort()

        page.route("**/*", route)
        page.on("requestfailed", lambda req: failed.append(req.url))
        page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda err: console_errors.append(str(err)))
        page.goto(f"file://{path}")
        page.wait_for_load_state("load")

        nodes = page.locator("#dag a.node")
        assert nodes.count() == len(exp.steps)
        shot = page.screenshot()
        target = exp.step("small/broken")
        node = page.locator(f'#dag a.node[data-node^="step-small_broken-{target.hash}"]')
        node.click()
        page.wait_for_function("location.hash.length > 1")
        section = page.locator(f"section#step-small_broken-{target.hash}")
        assert section.is_visible()
        assert "ValueError: shard 3 is corrupt" in section.inner_text()
        assert page.evaluate("document.querySelector('section.hl') && document.querySelector('section.hl').id") \
            == f"step-small_broken-{target.hash}"
        top = section.bounding_box()["y"]
        assert -2 <= top < 900, top  # scrolled into view (to within sub-pixel rounding)

        from io import BytesIO

        try:
            from PIL import Image

            img = Image.open(BytesIO(shot)).convert("L")
            lo, hi = img.getextrema()
            assert hi - lo > 100, "screenshot is blank"
        except ImportError:  # no Pillow: a blank PNG of this size compresses to a few KB
            assert len(shot) > 20_000
        assert not attempted, attempted
        assert not failed, failed
        assert not console_errors, console_errors
    finally:
        browser.close()


def test_screenshot_of_the_quickstart_report(playwright, tmp_path):
    """Regenerates the user guide's screenshot from a finished quickstart when asked (see docs)."""
    out = os.environ.get("MARIN_REPORT_SCREENSHOT")
    prefix = os.environ.get("MARIN_REPORT_PREFIX")
    if not out or not prefix:
        pytest.skip("set MARIN_REPORT_SCREENSHOT=docs/images/report.png and MARIN_REPORT_PREFIX=<finished quickstart>")
    path = write_report(mr.load(prefix=prefix), str(tmp_path / "report.html"))
    browser = _launch(playwright)
    try:
        page = browser.new_page(viewport={"width": 1200, "height": 1000})
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file://") else r.abort())
        page.goto(f"file://{path}")
        page.screenshot(path=out)
    finally:
        browser.close()
