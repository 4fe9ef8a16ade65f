"""The lab in a real browser: Debian's headless Chromium driven through chromedriver (selenium).

Starts ``fastweights lab`` on a free local port, loads the page, moves the N slider
past d and checks that the displayed recall drops, switches the rule to delta and
checks the overwrite numbers, types a bad N and checks the page shows the
server's message, resets to the worked example, and saves a screenshot of each
panel (into pytest's temporary folder; set ``FASTWEIGHTS_LAB_FIGURES=docs/figures`` to
refresh the README's screenshots, so a plain test run never rewrites tracked files). It prints the page's load
time and the time of a slider update (input event to redrawn page).

Needs ``/usr/bin/chromium`` and ``/usr/bin/chromedriver`` (``apt-get install chromium
chromium-driver``; ``.ci/run`` installs them) and selenium (the ``dev`` extra); skips
with a message where they are missing. Nothing is downloaded: the driver's path is
given, so selenium never fetches one.
"""

import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,3200")

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("no browser: Debian's chromium and chromium-driver are not installed "
                "(apt-get install -y chromium chromium-driver; .ci/run does this as root)", allow_module_level=True)

from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select, WebDriverWait


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    proc = subprocess.Popen([sys.executable, "-m", "fastweights.cli", "lab", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = None
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://\S+", line)
        assert match, f"fastweights lab printed {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        driver.set_page_load_timeout(30)
        yield driver, match.group(0)
    finally:
        if driver is not None:
            driver.quit()
        proc.terminate()
        proc.wait(10)


def wait(driver, condition, timeout=20):
    return WebDriverWait(driver, timeout, poll_frequency=0.02).until(lambda d: d.execute_script(condition))


def panel_update(driver, panel, action):
    """Do ``action``; wait until the panel has redrawn every request it caused; return its update time (ms)."""
    before = int(driver.execute_script(f"return document.getElementById('{panel}').dataset.seq"))
    action()
    wait(driver, f"const s = document.getElementById('{panel}'); return Number(s.dataset.seq) > {before} "
                 f"&& !LAB.busy['{panel}'] && !LAB.pending['{panel}']")
    return float(driver.execute_script(f"return document.getElementById('{panel}').dataset.updateMs"))


def set_slider(driver, panel, name, value):
    driver.execute_script(
        "const s = document.querySelector(`#${arguments[0]} input[type=range][name=${arguments[1]}]`);"
        "s.value = arguments[2]; s.dispatchEvent(new Event('input', {bubbles: true}));", panel, name, value)


def text(driver, css):
    return driver.find_element(By.CSS_SELECTOR, css).text


def test_lab_in_chromium(lab, tmp_path):
    driver, url = lab
    start = time.perf_counter()
    driver.get(url)
    wait(driver, "return document.body.dataset.ready === '1'")
    wall_ms = 1e3 * (time.perf_counter() - start)
    nav = driver.execute_script("const n = performance.getEntriesByType('navigation')[0];"
                                "return [n.domContentLoadedEventEnd, n.loadEventEnd, LAB.timings.ready];")
    print(f"\npage load: DOMContentLoaded {nav[0]:.0f} ms, load {nav[1]:.0f} ms, all four panels drawn "
          f"{nav[2]:.0f} ms after navigation start ({wall_ms:.0f} ms wall, from driver.get)")
    assert all(driver.execute_script(f"return document.getElementById('{p}').dataset.status") == "200"
               for p in ("interference", "geometry", "spotlight", "memory", "tracking"))

    # move N from below d to past it: the displayed recall drops
    d = int(driver.find_element(By.CSS_SELECTOR, "#interference input[type=number][name=d]").get_attribute("value"))
    panel_update(driver, "interference", lambda: set_slider(driver, "interference", "n", d // 2))
    below = float(text(driver, "#recall-value"))
    assert text(driver, "#n-value") == str(d // 2)
    panel_update(driver, "interference", lambda: set_slider(driver, "interference", "n", 3 * d))
    above = float(text(driver, "#recall-value"))
    print(f"displayed recall at N = {d // 2}: {below}; at N = {3 * d} (d = {d}): {above}")
    assert text(driver, "#n-value") == str(3 * d)
    assert below > 0.95 and above < below - 0.2

    # slider updates by the keyboard, one step each: input event -> redrawn page
    slider = driver.find_element(By.CSS_SELECTOR, "#interference input[type=range][name=n]")
    times = [panel_update(driver, "interference", lambda: slider.send_keys(Keys.ARROW_LEFT)) for _ in range(5)]
    print(f"slider update (N slider, d = {d}, sum rule, one step): median {statistics.median(times):.0f} ms, "
          f"max {max(times):.0f} ms over {len(times)} (input event to redrawn SVG, server compute included)")
    assert text(driver, "#n-value") == str(3 * d - 5)

    # the overwrite example: sum rule adds, the delta rule (β = 0.8) overwrites along k₁
    assert text(driver, "#overwrite-k1") == "(16, 6)"
    panel_update(driver, "interference", lambda: Select(driver.find_element(By.CSS_SELECTOR, "#interference select[name=rule]")).select_by_value("delta"))
    print("delta rule overwrite:", text(driver, "#overwrite-W"), text(driver, "#overwrite-k1"), text(driver, "#overwrite-k2"))
    assert text(driver, "#overwrite-W") == "[[9.8, 3], [3.6, 7]]"
    assert text(driver, "#overwrite-k1") == "(9.8, 3.6)"
    assert text(driver, "#overwrite-k2") == "(3, 7)"
    FIGURES = Path(os.environ.get("FASTWEIGHTS_LAB_FIGURES") or tmp_path)
    FIGURES.mkdir(parents=True, exist_ok=True)
    driver.find_element(By.ID, "interference").screenshot(str(FIGURES / "lab_interference.png"))

    # bad input typed on the page: the server's message appears, nothing else changes
    box = driver.find_element(By.CSS_SELECTOR, "#interference input[type=number][name=n]")
    panel_update(driver, "interference", lambda: (box.clear(), box.send_keys("0")))
    message = text(driver, "#interference .error")
    print("typed N = 0:", message)
    assert "`n` must be in [1, 256], got 0" in message
    assert driver.execute_script("return document.getElementById('interference').dataset.status") == "400"

    # reset: the two-key worked example, exactly
    panel_update(driver, "interference", lambda: driver.find_element(By.CSS_SELECTOR, "#interference .reset").click())
    cells = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#heat text")]
    print("reset: state cells", cells)
    assert cells == ["3", "1", "-2", "4"] and text(driver, "#interference .error") == ""
    assert text(driver, "#recall-value") == "1"

    # the other panels: step the 2-D writes, sharpen the spotlight, change the calculator
    panel_update(driver, "spotlight", lambda: set_slider(driver, "spotlight", "sharpness", 1.5))  # 10^1.5 ≈ 31.6
    share = float(re.search(r"target's share ([\d.]+)", text(driver, "#spot-bars figcaption")).group(1))
    print("softmax target share at sharpness 31.6:", share)
    assert share > 0.9
    driver.find_element(By.ID, "spotlight").screenshot(str(FIGURES / "lab_spotlight.png"))
    driver.find_element(By.ID, "geometry").screenshot(str(FIGURES / "lab_geometry.png"))
    driver.find_element(By.CSS_SELECTOR, "#geometry .prev").click()
    assert text(driver, "#geometry output[data-for=step]") == "3 / 4"
    assert "Sum rule W = [[10.4, 10.2], [2.6, 7.8]]" in text(driver, "#geometry-readout")  # Schlag et al. 2021's W_new
    memory_row = text(driver, "#memory-table tr[data-kind=softmax]")
    assert "64.0 GiB" in memory_row  # 32 layers × 32 heads × 131072 tokens × 256 × 2 bytes
    driver.find_element(By.ID, "memory").screenshot(str(FIGURES / "lab_memory.png"))

    # state tracking: type bits, the model's running answers and the reflections are drawn
    box = driver.find_element(By.CSS_SELECTOR, "#tracking textarea[name=bits]")
    panel_update(driver, "tracking", lambda: (box.clear(), box.send_keys("1101" * 40)))
    readout = text(driver, "#tracking-readout")
    print("tracking:", readout)
    assert "160 of 160 running answers right" in readout and "equals" in readout
    bars = driver.find_elements(By.CSS_SELECTOR, "#tracking-chart rect")
    assert len(bars) == 2 * 160
    panel_update(driver, "tracking", lambda: Select(driver.find_element(By.CSS_SELECTOR, "#tracking select[name=arm]")).select_by_value("deltanet[0,1]"))
    assert "does not follow" in text(driver, "#tracking-readout")
    panel_update(driver, "tracking", lambda: (box.clear(), box.send_keys("10a1")))
    assert "`bits` must be 1 to 512 characters 0 or 1" in text(driver, "#tracking .error")
    panel_update(driver, "tracking", lambda: driver.find_element(By.CSS_SELECTOR, "#tracking .reset").click())
    tracking = driver.find_element(By.ID, "tracking")
    driver.execute_script("arguments[0].scrollIntoView();", tracking)
    tracking.screenshot(str(FIGURES / "lab_tracking.png"))
    for name in ("interference", "geometry", "spotlight", "memory", "tracking"):
        path = FIGURES / f"lab_{name}.png"
        assert path.stat().st_size > 10_000, path
