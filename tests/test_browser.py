"""The admin's Locks page in a real browser: headless Chromium driven by Playwright.

Against a Django live server (the test settings, which install the admin) on
127.0.0.1: log in through the admin login form, open Locks, filter to stale, tick
the stale lock, force-release it through the confirmation page, and see it gone
while the held lock stays.

Needs the ``playwright`` Python package and a Chromium binary. Playwright cannot
download its own browser here, so it drives Debian's ``chromium`` package
(``apt-get install chromium``; another binary with ``SETNX_CHROMIUM=/path``). When
either is missing the test is skipped, except with ``CI=true``, where it fails.

``SETNX_SCREENSHOT=1`` saves a screenshot of the Locks page to
``docs/admin-locks.png`` (the one in the README).
"""

import os
import shutil
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from django.conf import settings

from django_setnx import lock, locks

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOT = os.environ.get("SETNX_SCREENSHOT", "").lower() in ("1", "true", "yes")
SCREENSHOT_PATH = ROOT / "docs" / "admin-locks.png"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
USERNAME = "browser-admin"
PASSWORD = "browser-admin-password"
HELD_NAME = "browser:held-report"
STALE_NAME = "browser:stale-sync"


def _chromium():
    candidates = [
        os.environ.get("SETNX_CHROMIUM", ""),
        "/usr/bin/chromium",
        shutil.which("chromium") or "",
        shutil.which("chromium-browser") or "",
    ]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def _missing():
    """Why the browser test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install playwright)"
    if _chromium() is None:
        return (
            "no Chromium binary at /usr/bin/chromium (apt-get install chromium; "
            "or set SETNX_CHROMIUM=/path/to/chromium)"
        )
    return None


@pytest.fixture
def browser_page():
    reason = _missing()
    if reason is not None:
        if settings.CI:
            pytest.fail(f"CI=true: the browser test must run, but {reason}.")
        pytest.skip(f"Browser test skipped: {reason}.")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS
        )
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 900})
            page = context.new_page()
            page.set_default_timeout(15_000)
            yield page
            context.close()
        finally:
            browser.close()


@pytest.fixture
def server_url(transactional_db):
    """A live server on 127.0.0.1 serving the test settings' admin, static files too.

    Like pytest-django's ``live_server``, but bound to 127.0.0.1 and with a
    ``STATIC_URL`` (the test settings have none), so the admin's CSS and its
    actions JavaScript load as they do on a real site.
    """
    from django.contrib.staticfiles.handlers import StaticFilesHandler
    from django.test import override_settings
    from django.test.testcases import LiveServerThread

    with override_settings(STATIC_URL="/static/"):
        thread = LiveServerThread("127.0.0.1", StaticFilesHandler, port=0)
        thread.daemon = True
        thread.start()
        thread.is_ready.wait(timeout=30)
        if thread.error:
            raise thread.error
        try:
            yield f"http://127.0.0.1:{thread.port}"
        finally:
            thread.terminate()


@pytest.fixture
def seeded_locks(transactional_db):
    """One held and one stale lock on the "default" (SQLite) backend."""
    store = locks["default"]
    assert lock(HELD_NAME, ttl=3600, timeout=0, guards="POST /reports/ (browser test)").acquire()
    assert lock(STALE_NAME, ttl=0.05, timeout=0, guards="celery task sync (worker died)").acquire()
    deadline = time.monotonic() + 5
    while store.get(STALE_NAME).is_held:
        assert time.monotonic() < deadline, "the 50 ms lock did not go stale"
        time.sleep(0.05)
    yield store
    store.clear(include_held=True)


@pytest.fixture
def admin_user(transactional_db, django_user_model):
    return django_user_model.objects.create_superuser(
        USERNAME, "browser@example.invalid", PASSWORD
    )


def _list_with(**query):
    """A wait_for_url() predicate: the Locks page with exactly this query."""

    def matches(url):
        parts = urlsplit(url)
        return (
            parts.path == "/admin/django_setnx/lockrecord/"
            and dict(parse_qsl(parts.query)) == query
        )

    return matches


def test_force_release_a_stale_lock_in_the_browser(
    server_url, admin_user, seeded_locks, browser_page
):
    page = browser_page
    base = server_url

    # Log in through the admin's own login form.
    page.goto(f"{base}/admin/")
    assert "/admin/login/" in page.url
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}/admin/")

    # The admin index links to the Locks page under the app.
    page.click("a[href='/admin/django_setnx/lockrecord/']")
    page.wait_for_url("**/admin/django_setnx/lockrecord/")
    rows = page.locator("#result_list tbody tr")
    assert page.locator("#result_list th.field-name", has_text=HELD_NAME).count() == 1
    assert page.locator("#result_list th.field-name", has_text=STALE_NAME).count() == 1
    if SCREENSHOT:
        SCREENSHOT_PATH.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT_PATH), full_page=True)

    # Filter to stale: only the stale lock is left.
    page.locator("#changelist-filter a", has_text="Stale").click()
    page.wait_for_url(_list_with(state="stale"))
    assert rows.count() == 1
    stale_row = rows.filter(has_text=STALE_NAME)
    assert stale_row.locator(".field-state").inner_text().strip() == "stale"

    # Tick it, choose the action, Go.
    stale_row.locator("input.action-select").check()
    assert "1 of 1 selected" in page.locator(".action-counter").inner_text()
    page.select_option("select[name=action]", "release_selected")
    page.click("#changelist-form button[type=submit]")

    # The confirmation page names the lock; confirm.
    page.wait_for_selector("li.lock-to-release")
    assert page.locator("#content h1").first.inner_text() == "Are you sure?"
    assert STALE_NAME in page.locator("li.lock-to-release").inner_text()
    page.click("input[type=submit][value='Yes, I’m sure']")

    # Back on the list as it was left (stale only): the stale lock is gone ...
    page.wait_for_url(_list_with(state="stale"))
    assert page.locator("ul.messagelist li").count() >= 1
    assert page.locator("#result_list th.field-name", has_text=STALE_NAME).count() == 0
    assert seeded_locks.get(STALE_NAME) is None
    # ... and the held one is still there.
    page.locator("#changelist-filter details[data-filter-title=state] a", has_text="All").click()
    page.wait_for_url(_list_with())
    assert page.locator("#result_list th.field-name", has_text=HELD_NAME).count() == 1
    assert seeded_locks.get(HELD_NAME).is_held


def _log_in(page, base):
    page.goto(f"{base}/admin/")
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{base}/admin/")


def test_sort_counts_and_the_list_kept_across_actions_in_the_browser(
    server_url, admin_user, seeded_locks, browser_page
):
    """Show counts, filter, sort by a header and reverse it, "Go" without an
    action, cancel a confirmation, confirm one: the list stays as it was left."""
    page = browser_page
    base = server_url
    # Three more stale locks with fencing tokens 1, 2 and 3.
    stale = [f"browser:stale-{token}" for token in (1, 2, 3)]
    for token, name in enumerate(stale, 1):
        for _ in range(token - 1):
            lk = lock(name, ttl=60, backend="default")
            assert lk.acquire(blocking=False)
            lk.release()
        assert lock(name, ttl=0.05, backend="default").acquire(blocking=False)
    time.sleep(0.1)
    _log_in(page, base)
    page.goto(f"{base}/admin/django_setnx/lockrecord/")

    page.click("#changelist-filter a.viewlink")  # "Show counts"
    page.wait_for_url(_list_with(_facets="True"))
    page.locator("#changelist-filter a", has_text="Stale (4)").click()
    page.wait_for_url(_list_with(_facets="True", state="stale"))

    names = page.locator("#result_list tbody th.field-name")
    page.click("#result_list thead th.column-fencing_token a")  # sort by it
    page.wait_for_url(_list_with(_facets="True", state="stale", o="5"))
    header = page.locator("#result_list thead th.column-fencing_token")
    assert "sorted ascending" in header.get_attribute("class")
    page.click("#result_list thead th.column-fencing_token a.toggle")
    page.wait_for_url(_list_with(_facets="True", state="stale", o="-5"))
    assert "sorted descending" in header.get_attribute("class")
    assert names.all_inner_texts()[:3] == [stale[2], stale[1], stale[0]]
    listed_url = page.url

    # Ticked, but no action chosen: Django's warning, on the same list.
    page.locator("tr", has_text=stale[2]).locator("input.action-select").check()
    page.click("#changelist-form button[type=submit]")
    page.wait_for_selector("ul.messagelist li.warning")
    assert page.locator("ul.messagelist li.warning").inner_text() == "No action selected."
    assert page.url == listed_url

    # The confirmation's "No, take me back" returns to that list.
    page.locator("tr", has_text=stale[2]).locator("input.action-select").check()
    page.select_option("select[name=action]", "release_selected")
    page.click("#changelist-form button[type=submit]")
    page.wait_for_selector("li.lock-to-release")
    page.click("a.cancel-link")
    page.wait_for_url(listed_url)
    assert seeded_locks.get(stale[2]) is not None

    # Confirmed: released, and back on the same list.
    page.locator("tr", has_text=stale[2]).locator("input.action-select").check()
    page.select_option("select[name=action]", "release_selected")
    page.click("#changelist-form button[type=submit]")
    page.wait_for_selector("li.lock-to-release")
    page.click("input[type=submit][value='Yes, I’m sure']")
    page.wait_for_selector("ul.messagelist li.success")
    assert page.url == listed_url
    assert names.all_inner_texts() == [stale[1], stale[0], STALE_NAME]
    assert page.locator("#changelist-filter a", has_text="Stale (3)").count() == 1
    assert seeded_locks.get(stale[2]) is None
