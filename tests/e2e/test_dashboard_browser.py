"""The dashboard in a real headless browser during a real run: ``flodl run --dashboard`` trains
digits with 3 ranks while Chromium (Debian's, driven by selenium through chromium-driver)
shows the page; it must show every rank and a round number that goes up.

The screenshot goes to the test's folder; with ``FLODL_SAVE_SCREENSHOT=1`` it is also copied to
docs/images/dashboard.png (how that picture was made).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.worker.procs import pid_alive

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "examples" / "digits.py"
SCREENSHOT = ROOT / "docs" / "images" / "dashboard.png"
T = TypeVar("T")


def _find(*names: str) -> str | None:
    for name in names:
        found = shutil.which(name) or (name if os.path.isfile(name) else None)
        if found:
            return found
    return None


CHROMIUM = _find("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = _find("chromedriver", "/usr/lib/chromium/chromedriver")


@contextmanager
def flodl_run(run_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str, list[str]]]:
    """``flodl run --dashboard 127.0.0.1:0`` in a session of its own; yields it, the dashboard
    URL it printed and the lines it printed so far (kept being read). On exit the run is
    interrupted if still going, and killed with its session if that did not end it."""
    argv = [sys.executable, "-m", "flodl.cli", "run", "--nproc", "3", "--no-live"]
    argv += ["--dashboard", "127.0.0.1:0", "--run-dir", str(run_dir), str(DIGITS)]
    # Long enough to outlast a slow browser start on a busy machine; the test stops it.
    argv += ["--epochs", "400", "--slow", "2:2"]
    process = subprocess.Popen(
        argv,
        cwd=run_dir.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "flodl: dashboard at " in line:
                found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        found.wait(60)
        urls = [m.group(1) for m in map(re.compile(r"dashboard at (\S+)").search, lines) if m]
        assert urls, "no dashboard line:\n" + "\n".join(lines)
        yield process, urls[0], lines
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        reader.join(10)
        process.stdout.close()


def wait_for(driver: Any, what: str, probe: Callable[[], T | None], limit: float) -> T:
    """``probe()`` once it is not None, within ``limit`` seconds: a page's content changes
    without telling WebDriver, so Selenium's own wait asks again every 0.2 s."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.wait import WebDriverWait

    def present(_driver: Any) -> tuple[T] | None:
        value = probe()
        return None if value is None else (value,)  # a tuple: a falsy value counts too

    try:
        found = WebDriverWait(driver, limit, poll_frequency=0.2).until(present)
    except TimeoutException:
        raise AssertionError(f"{what}: not within {limit} s") from None
    assert found is not None  # until returns only what the condition returned when true
    return found[0]


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = str(CHROMIUM)
    return webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt-get install chromium)")
@pytest.mark.skipif(
    CHROMEDRIVER is None, reason="no chromedriver on PATH (apt-get install chromium-driver)"
)
def test_the_page_shows_every_rank_and_rounds_going_up(tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    run_dir = tmp_path / "run"
    with flodl_run(run_dir) as (process, url, lines):
        driver = browser()
        driver_pid = driver.service.process.pid
        try:
            driver.get(url)

            def round_shown() -> int | None:
                text = driver.find_element(By.ID, "round").text
                return int(text) if text.isdigit() and int(text) >= 1 else None

            def rank_rows() -> list[str] | None:
                rows = driver.find_elements(By.CSS_SELECTOR, "#ranks tr")
                ranks = [row.get_attribute("data-rank") or "" for row in rows]
                return ranks if len(ranks) == 3 else None

            first = wait_for(driver, "a round on the page", round_shown, 90)
            assert rank_rows() == ["0", "1", "2"]
            states = [
                cell.text
                for cell in driver.find_elements(By.CSS_SELECTOR, "#ranks td:nth-child(2)")
            ]
            assert states == ["training"] * 3
            later = wait_for(
                driver,
                "the round going up",
                lambda: r if (r := round_shown()) is not None and r >= first + 6 else None,
                60,
            )
            assert later > first
            # The plots are drawn from the event history: one line per rank.
            lines_drawn = driver.find_elements(By.CSS_SELECTOR, "#plot-rate polyline")
            assert len(lines_drawn) == 3
            assert driver.find_element(By.ID, "connection").text == "live"
            shot = tmp_path / "dashboard.png"
            assert driver.save_screenshot(str(shot))
            if os.environ.get("FLODL_SAVE_SCREENSHOT") == "1":
                SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(shot, SCREENSHOT)
        finally:
            driver.quit()
        process.send_signal(signal.SIGINT)  # every rank saves and stops: exit status 0
        process.wait(120)
        assert process.returncode == 0, "\n".join(lines)
        assert "flodl: run saved (saved: GRACEFUL)" in lines, "\n".join(lines)
    summary = (run_dir / "summary.json").read_text()
    pids = [int(p) for p in re.findall(r'"pid": (\d+)', summary)]
    assert len(pids) == 3
    assert not any(pid_alive(pid) for pid in [*pids, driver_pid, process.pid])
