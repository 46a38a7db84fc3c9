"""The console in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by Selenium) against a console process and the suite's services."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.wait import WebDriverWait
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Outbox
from outbox.dev.topics import read_topic
from outbox.settings import Settings
from tests.conftest import count_status, running_relay, wait_delivered, wait_until
from tests.integration.test_console import (
    SCRIPT,
    SCRIPT_KEY,
    TOKEN,
    actions_of,
    parked,
    running_console,
    with_actions,
)

__all__ = ["parked"]  # the fixture, shared with the HTTP tests


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                     "--window-size=1400,1600"):
        options.add_argument(argument)
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "scripts/bootstrap.sh installs chromium and chromium-driver"
    options.binary_location = chromium
    # The system's chromedriver, named explicitly: Selenium then downloads nothing.
    session = webdriver.Chrome(service=Service(driver), options=options)
    yield session
    session.quit()


def cell(browser: WebDriver, css: str) -> str:
    """The text of ``css``; when the page has none, the failure shows the page instead (a
    missing row said nothing of what the console served)."""
    found = browser.find_elements(By.CSS_SELECTOR, css)
    if not found:
        pytest.fail(f"no {css} on {browser.current_url}, which shows:\n"
                    f"{browser.find_element(By.TAG_NAME, 'body').text[:3000]}")
    return str(found[0].text)


def after_submit(browser: WebDriver, css: str) -> str:
    """The text of ``css`` on the page a form submission leads to (a click does not wait
    for the next page)."""
    WebDriverWait(browser, 30).until(
        expected_conditions.presence_of_element_located((By.CSS_SELECTOR, css)))
    return cell(browser, css)


def test_the_numbers_on_the_page_are_the_databases(
    browser: WebDriver, engine: Engine, settings: Settings, schema: str, topic: str,
    parked: list[int]
) -> None:
    outbox = Outbox(settings=settings)
    with running_relay(settings):
        with Session(engine) as session, session.begin():
            for n in range(5):
                outbox.publish(session, topic, {"n": n}, key=f"k{n}")
        wait_delivered(engine, schema, 5)
    with Session(engine) as session, session.begin():
        for n in range(3):
            outbox.publish(session, topic, {"left": n})
    with engine.connect() as conn:
        counts = dict(conn.execute(text(
            f"SELECT status, count(*) FROM {schema}.message_state GROUP BY status")).all())

    with running_console(settings) as url:
        browser.get(url)
        shown = {state: int(cell(browser, f"#total-{state}"))
                 for state in ("pending", "parked", "delayed", "unresolved", "discarded")}
        row = f'tr[data-topic="{topic}"]'
        shown_topic = {state: int(cell(browser, f'{row} td[data-state="{state}"]'))
                       for state in ("pending", "parked", "delivered_last_minute")}
        delivered_hour = int(cell(browser, "#delivered-hour"))
        held = {int(r.get_attribute("data-message") or 0)
                for r in browser.find_elements(By.CSS_SELECTOR, "tr[data-message]")}

    assert counts == {"DELIVERED": 5, "PENDING": 3, "PARKED": 2}
    assert shown == {"pending": 3, "parked": 2, "delayed": 0, "unresolved": 0, "discarded": 0}
    assert shown_topic == {"pending": 3, "parked": 2, "delivered_last_minute": 5}
    assert delivered_hour == 5
    assert held == set(parked)


def test_payload_and_key_with_script_render_as_text(
    browser: WebDriver, settings: Settings, parked: list[int]
) -> None:
    with running_console(settings) as url:
        browser.get(url)
        row = f'tr[data-message="{parked[0]}"]'
        key = cell(browser, f"{row} td.key")
        preview = cell(browser, f"{row} pre.preview")
        scripts = browser.execute_script("return document.scripts.length")
        with pytest.raises(NoAlertPresentException):
            browser.switch_to.alert.text  # noqa: B018 (reading it is the check)

    assert key == SCRIPT_KEY
    assert preview.startswith(SCRIPT.decode() + "xxx")
    assert scripts == 1, "only the console's own refresh script"


def test_resume_a_parked_message_through_the_page_and_see_it_delivered(
    browser: WebDriver, engine: Engine, settings: Settings, schema: str, topic: str,
    parked: list[int]
) -> None:
    with running_relay(settings), with_actions(settings) as url:
        browser.get(url)
        browser.find_element(By.NAME, "operator").send_keys("alice")
        browser.find_element(By.NAME, "token").send_keys(TOKEN)
        browser.find_element(By.CSS_SELECTOR, f'button[name="one"][value="{parked[1]}"]').click()
        outcome = after_submit(browser, "#outcome")
        wait_until(lambda: count_status(engine, schema, "DELIVERED") == 1, 30,
                   "the resumed message delivered")

    assert f"message {parked[1]} (was PARKED)" in outcome
    assert [r.message_id for r in read_topic(settings.kafka_bootstrap, topic)] == [parked[1]]
    history = actions_of(engine, schema, parked[1])
    assert [action for action, _ in history] == ["PARKED", "RESUMED", "DELIVERED"]
    assert history[1] == ("RESUMED", "console:alice")
    assert count_status(engine, schema, "PARKED") == 1, "the other one is left alone"


def test_a_wrong_token_typed_in_the_page_is_refused(
    browser: WebDriver, engine: Engine, settings: Settings, schema: str, parked: list[int]
) -> None:
    with with_actions(settings) as url:
        browser.get(url)
        for message_id in parked:
            browser.find_element(By.CSS_SELECTOR, f'input[name="ids"][value="{message_id}"]'
                                 ).click()
        browser.find_element(By.NAME, "operator").send_keys("mallory")
        browser.find_element(By.NAME, "token").send_keys("guess")
        browser.find_element(By.ID, "resume-selected").click()
        refused = after_submit(browser, "#refused")

    assert refused == "refused: wrong or missing token"
    assert count_status(engine, schema, "PARKED") == 2


def test_a_read_only_page_has_no_action(browser: WebDriver, settings: Settings,
                                        parked: list[int]) -> None:
    with running_console(settings) as url:
        browser.get(url)
        mode = cell(browser, "#mode")
        controls = browser.find_elements(By.CSS_SELECTOR, "form.resume, button[name=one], "
                                         "input[name=ids], input[name=token]")

    assert mode == "read-only"
    assert controls == []
