"""The playground page in a real headless browser (Debian's chromium and chromium-driver, through
selenium) against a real server: streaming, stop, reload mid-answer."""

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import KEY

pytestmark = pytest.mark.slow

CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

if not (CHROMIUM and os.path.exists(CHROMEDRIVER)):
    pytest.skip(
        "no chromium and chromium-driver here: `make test` installs them from Debian's packages when run as root",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def page(browser, server):
    browser.get(server + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text not in ("", "…"))
    return browser


def set_field(driver, field_id, value):
    field = driver.find_element(By.ID, field_id)
    field.clear()
    field.send_keys(str(value))


def ask(driver, text):
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()


def live_text(driver):
    found = driver.find_elements(By.CSS_SELECTOR, "#live .text")
    return found[0].text if found else None


def answers(driver):
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".msg.assistant:not(#live) .text")]


def idle(driver):
    return driver.find_element(By.ID, "send").is_enabled()


def test_a_prompt_streams_into_the_page_and_the_conversation_continues(page, server):
    set_field(page, "max-tokens", 40)
    set_field(page, "temperature", 0)
    ask(page, "Name three colors.")
    # Text shows up while the answer is still being generated.
    WebDriverWait(page, 60, poll_frequency=0.05).until(lambda d: live_text(d))
    WebDriverWait(page, 120).until(idle)
    first = answers(page)
    assert len(first) == 1 and first[0]
    assert page.find_element(By.ID, "t-ttft").text.endswith("ms")
    ask(page, "And three animals?")
    WebDriverWait(page, 120).until(lambda d: idle(d) and len(answers(d)) == 2)
    # The second turn continued the stored conversation: its prompt came largely from the cache.
    assert int(page.find_element(By.ID, "t-cached").text) > 0
    screenshot = os.environ.get("SLUICE_PLAYGROUND_SCREENSHOT")
    if screenshot:
        Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
        page.save_screenshot(screenshot)


def test_stop_cancels_the_answer_and_the_server_frees_it(page, server):
    set_field(page, "max-tokens", 2000)
    ask(page, "Write a very long story about a lighthouse keeper and the sea.")
    WebDriverWait(page, 60, poll_frequency=0.05).until(lambda d: live_text(d))
    page.find_element(By.ID, "stop").click()
    WebDriverWait(page, 60).until(idle)
    assert answers(page)[-1].endswith("[stopped]")
    deadline = time.monotonic() + 10
    while httpx.get(f"{server}/health").json()["num_running"]:
        assert time.monotonic() < deadline, "the stopped request is still running"
        time.sleep(0.1)


def test_a_reload_mid_answer_resumes_the_stream(page, server):
    set_field(page, "max-tokens", 120)
    set_field(page, "temperature", 0)
    ask(page, "Write a story about a dragon who learns to cook.")
    WebDriverWait(page, 60, poll_frequency=0.05).until(lambda d: len(live_text(d) or "") > 20)
    before = live_text(page)
    page.refresh()
    # After the reload the page picks the answer up where it was and carries on.
    WebDriverWait(page, 120).until(lambda d: idle(d) and answers(d))
    final = answers(page)[-1]
    assert final.startswith(before) and len(final) > len(before)
    # Exactly what the server generated, no more and no less.
    response_id = page.execute_script("return JSON.parse(sessionStorage.getItem('sluice-playground')).previous")
    assert final == httpx.get(f"{server}/v1/responses/{response_id}").json()["output"][0]["content"][0]["text"]


def test_the_page_asks_for_an_api_key_when_the_server_needs_one(browser, door):
    keyed_server, _, _ = door
    browser.get(keyed_server + "/")
    browser.execute_script("sessionStorage.clear(); localStorage.clear()")
    browser.get(keyed_server + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "api-key").is_displayed())
    assert browser.find_element(By.ID, "model").text == "API key needed"
    key = browser.find_element(By.ID, "api-key")
    key.send_keys(KEY)
    # Leaving the field commits the key; the page then reads the model list with it.
    browser.find_element(By.ID, "prompt").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text not in ("", "…", "API key needed"))
    set_field(browser, "max-tokens", 16)
    ask(browser, "Hello!")
    WebDriverWait(browser, 120).until(lambda d: idle(d) and answers(d))
    assert answers(browser)[-1]
    browser.execute_script("localStorage.clear()")


def picture_file(tmp_path, seed: int) -> Path:
    import numpy as np
    from PIL import Image

    path = tmp_path / f"picture-{seed}.png"
    Image.fromarray((np.random.RandomState(seed).rand(30, 40, 3) * 255).astype("uint8")).save(path)
    return path


def paste_image(driver, path: Path) -> None:
    """What pasting a copied image does: a paste event on the prompt whose clipboard holds a PNG file."""
    import base64

    data = base64.b64encode(path.read_bytes()).decode()
    driver.execute_script(
        """
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const clipboard = new DataTransfer();
        clipboard.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
        document.getElementById("prompt").dispatchEvent(
            new ClipboardEvent("paste", { clipboardData: clipboard, bubbles: true, cancelable: true }));
        """,
        data,
    )


def attached_images(driver):
    return driver.find_elements(By.CSS_SELECTOR, "#attachments img")


def test_an_image_attached_and_pasted_goes_with_the_message_and_shows_in_the_conversation(
    browser, vision_server, tmp_path
):
    browser.get(vision_server + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(vision_server + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "model").text not in ("", "…"))
    set_field(browser, "max-tokens", 12)
    set_field(browser, "temperature", 0)
    browser.find_element(By.ID, "image").send_keys(str(picture_file(tmp_path, 1)))
    paste_image(browser, picture_file(tmp_path, 2))
    WebDriverWait(browser, 10).until(lambda d: len(attached_images(d)) == 2)
    ask(browser, "What is in these pictures?")
    WebDriverWait(browser, 120).until(lambda d: idle(d) and answers(d))
    assert not attached_images(browser)
    shown = browser.find_elements(By.CSS_SELECTOR, ".msg.user img.image")
    assert [img.get_attribute("src").startswith("data:image/png;base64,") for img in shown] == [True, True]
    answer = answers(browser)[-1]
    response_id = browser.execute_script("return JSON.parse(sessionStorage.getItem('sluice-playground')).previous")
    stored = httpx.get(f"{vision_server}/v1/responses/{response_id}").json()
    assert answer and answer == stored["output"][0]["content"][0]["text"]
    # Two images' tokens (16 each on this model) are in the prompt the server counted.
    assert stored["usage"]["input_tokens"] > 32
    # The next turn continues the conversation, its images read again from the stored one.
    ask(browser, "And the second one?")
    WebDriverWait(browser, 120).until(lambda d: idle(d) and len(answers(d)) == 2)
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")


def test_an_image_sent_to_a_text_only_model_shows_the_servers_refusal(page, tmp_path):
    page.find_element(By.ID, "image").send_keys(str(picture_file(tmp_path, 1)))
    WebDriverWait(page, 10).until(lambda d: len(attached_images(d)) == 1)
    ask(page, "What is this?")
    WebDriverWait(page, 60).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.error"))
    error = page.find_element(By.CSS_SELECTOR, ".msg.error .text").text
    assert "input[0].content[1].image_url" in error and "takes text only" in error
