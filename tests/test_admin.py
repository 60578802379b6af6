"""The admin's Locks page, with the Django test client, against the real backends.

Tests that take ``alias`` run once per backend of the contract suite (SQLite,
PostgreSQL and MariaDB/MySQL when reachable, Redis, local memory): the database
backend is read through SQL, Redis through SCAN, local memory through the generic
streaming ``list()``.

The tests are transactional (``transaction=True``): on SQLite the test's own
connection would otherwise hold the write lock (creating users) while the lock
backend's separate connection tries to write.
"""

import datetime
import html
import json
import time
import uuid
import zoneinfo
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

import pytest
from django.conf import settings
from django.contrib import admin
from django.contrib.admin.models import DELETION, LogEntry

try:
    from django.contrib.admin.options import ShowFacets
except ImportError:  # Django 4.2: the admin has no facets ("Show counts").
    ShowFacets = None
from django.contrib.auth.models import Permission, User
from django.db import connections
from django.test import Client, override_settings
from django.urls import reverse
from django.utils import timezone, translation
from django.utils.safestring import mark_safe

from django_setnx import lock, locks, semaphore
from django_setnx.backends import paging
from django_setnx.backends.base import STALE
from django_setnx.backends.database import DatabaseBackend
from django_setnx.globs import search_to_glob
from django_setnx.models import LockRecord
from django_setnx.signals import lock_force_released

#: On every test function itself: the conftest adds a non-transactional django_db
#: marker to each test, and the function's own marker is the closest one.
transactional = pytest.mark.django_db(transaction=True, databases="__all__")

LIST_URL = "admin:django_setnx_lockrecord_changelist"
RELEASE_URL = "admin:django_setnx_lockrecord_release"
CLEAR_URL = "admin:django_setnx_lockrecord_clear"
XSS = "<script>alert(1)</script>"
XSS_ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


# -- helpers -------------------------------------------------------------------------


def make_user(username, *codenames):
    user = User.objects.create_user(username, password="pw", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_setnx", codename=codename)
        )
    return user


@pytest.fixture
def viewer():
    return make_user("viewer", "view_lockrecord")


@pytest.fixture
def releaser():
    return make_user("releaser", "view_lockrecord", "release_lock")


def logged_in(user, **kwargs):
    client = Client(**kwargs)
    client.force_login(user)
    return client


def hold(alias, name, ttl=300, guards=None):
    lk = lock(name, ttl=ttl, backend=alias, guards=guards)
    assert lk.acquire(blocking=False)
    return lk


def make_stale(alias, name):
    lk = lock(name, ttl=0.05, backend=alias)
    assert lk.acquire(blocking=False)
    deadline = time.monotonic() + 5
    while not locks[alias].get(name).is_stale:
        assert time.monotonic() < deadline, "the lock did not become stale"
        time.sleep(0.02)
    return lk


def list_url(**params):
    url = reverse(LIST_URL)
    return url + ("?" + urlencode(params) if params else "")


def listed_names(response):
    return [row["name"] for row in response.context["rows"] if "semaphore" not in row]


def confirm_value(alias, name, token):
    return json.dumps([alias, name, token])


def confirmed_release(client, alias, name, token):
    """POST the confirmed force-release of ``name``; returns the page it leads to."""
    response = client.post(
        reverse(RELEASE_URL),
        {"lock": confirm_value(alias, name, token), "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    return response.content.decode()


@pytest.fixture
def force_released():
    received = []

    def receiver(sender, **kwargs):
        received.append({"sender": sender, **kwargs})

    lock_force_released.connect(receiver)
    yield received
    lock_force_released.disconnect(receiver)


def other_alias(alias):
    return next(a for a in settings.SETNX_LOCKS if a != alias)


@pytest.fixture
def other(alias):
    """A second backend, emptied at the end (it may be "locmem" even when the run
    leaves local memory out, and then nothing else would empty it)."""
    other = other_alias(alias)
    yield other
    locks[other].clear(include_held=True)


# -- permissions -----------------------------------------------------------------------


@transactional
def test_anonymous_is_redirected_to_login(client):
    for url in (reverse(LIST_URL), reverse(RELEASE_URL), reverse(CLEAR_URL)):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("admin:login"))
    response = client.post(reverse(RELEASE_URL), {"post": "yes"})
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("admin:login"))


@transactional
def test_staff_without_permission_is_refused(name):
    hold("default", name)
    client = logged_in(make_user("nobody"))
    assert client.get(reverse(LIST_URL)).status_code == 403
    assert (
        client.get(reverse(RELEASE_URL), {"lock": json.dumps(["default", name])}).status_code
        == 403
    )
    assert client.get(reverse(CLEAR_URL)).status_code == 403
    response = client.post(
        reverse(RELEASE_URL),
        {
            "lock": confirm_value("default", name, locks["default"].get(name).fencing_token),
            "post": "yes",
        },
    )
    assert response.status_code == 403
    assert locks["default"].get(name) is not None
    # The release permission alone (without view) does not open the actions either.
    client = logged_in(make_user("release-only", "release_lock"))
    assert client.get(reverse(LIST_URL)).status_code == 403
    assert client.post(reverse(CLEAR_URL), {"post": "yes"}).status_code == 403


@transactional
def test_admin_index_links_to_the_locks_page(viewer):
    response = logged_in(viewer).get(reverse("admin:index"))
    assert response.status_code == 200
    content = response.content.decode()
    assert f'href="{reverse(LIST_URL)}"' in content
    # No add link: locks are made by code, not by the admin.
    assert "/admin/django_setnx/lockrecord/add/" not in content


@transactional
def test_view_only_user_sees_the_list_but_cannot_release(alias, name, viewer):
    info = hold(alias, name, guards="app.views.report").fencing_token
    client = logged_in(viewer)
    response = client.get(list_url())
    assert response.status_code == 200
    content = response.content.decode()
    assert name in listed_names(response)
    assert name in content
    assert "app.views.report" in content
    assert 'class="action-select"' not in content
    assert "Force-release selected locks" not in content
    assert reverse(CLEAR_URL) not in content
    # Forged POSTs: refused, nothing released.
    selection = json.dumps([alias, name])
    assert (
        client.post(
            list_url(), {"action": "release_selected", "_selected_action": [selection]}
        ).status_code
        == 403
    )
    assert client.get(reverse(RELEASE_URL), {"lock": selection}).status_code == 403
    assert (
        client.post(
            reverse(RELEASE_URL), {"lock": confirm_value(alias, name, info), "post": "yes"}
        ).status_code
        == 403
    )
    assert client.post(reverse(CLEAR_URL), {"post": "yes"}).status_code == 403
    assert locks[alias].get(name) is not None
    assert not LogEntry.objects.exists()


# -- force-release -----------------------------------------------------------------------


@transactional
def test_release_through_the_confirmation_page(alias, name, releaser, force_released):
    hold(alias, name, guards="app.tasks.nightly")
    token = locks[alias].get(name).fencing_token
    client = logged_in(releaser)

    response = client.get(list_url())
    content = response.content.decode()
    assert 'class="action-select"' in content
    assert "Force-release selected locks" in content

    # The list's form posts the selection: the answer is the confirmation page.
    response = client.post(
        list_url(), {"action": "release_selected", "_selected_action": [json.dumps([alias, name])]}
    )
    assert response.status_code == 200
    assert "Are you sure" in response.content.decode()
    # ... which can also be reached with GET.
    response = client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])})
    assert response.status_code == 200
    content = response.content.decode()
    assert f"fencing token {token}" in content
    assert [row["confirm_value"] for row in response.context["found"]] == [
        confirm_value(alias, name, token)
    ]
    assert locks[alias].get(name) is not None  # nothing happens before the POST

    response = client.post(
        reverse(RELEASE_URL),
        {"lock": confirm_value(alias, name, token), "post": "yes"},
        follow=True,
    )
    assert response.redirect_chain[-1][0] == reverse(LIST_URL)
    assert locks[alias].get(name) is None
    assert "Force-released 1 lock" in response.content.decode()

    entry = LogEntry.objects.get()
    assert entry.user == releaser
    assert entry.action_flag == DELETION
    assert entry.object_repr == f"{alias}: {name}"
    assert entry.content_type.model_class().__name__ == "LockRecord"
    assert "Force-released" in entry.get_change_message()
    assert f"fencing token {token}" in entry.get_change_message()

    assert len(force_released) == 1
    sent = force_released[0]
    assert sent["sender"] is type(locks[alias])
    assert sent["backend"] == alias
    assert sent["name"] == name
    assert sent["info"].name == name and sent["info"].fencing_token == token
    assert sent["user"] == releaser
    assert sent["reason"] == f"force-released in the admin by {releaser.get_username()}"


@transactional
def test_release_is_refused_when_the_lock_changed_hands(alias, name, releaser, force_released):
    first = hold(alias, name)
    shown = locks[alias].get(name).fencing_token
    client = logged_in(releaser)
    assert client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])}).status_code == 200
    # Between the confirmation page and the POST, the lock is released and re-acquired.
    first.release()
    hold(alias, name)
    now = locks[alias].get(name).fencing_token
    assert now > shown

    response = client.post(
        reverse(RELEASE_URL),
        {"lock": confirm_value(alias, name, shown), "post": "yes"},
        follow=True,
    )
    assert response.status_code == 200
    assert locks[alias].get(name).fencing_token == now  # the new holder keeps it
    assert "changed hands" in response.content.decode()
    assert not LogEntry.objects.exists()
    assert force_released == []


@transactional
def test_release_of_a_lock_already_gone(alias, name, releaser):
    lk = hold(alias, name)
    token = locks[alias].get(name).fencing_token
    lk.release()
    response = logged_in(releaser).post(
        reverse(RELEASE_URL),
        {"lock": confirm_value(alias, name, token), "post": "yes"},
        follow=True,
    )
    assert "Already gone" in response.content.decode()
    assert not LogEntry.objects.exists()


@transactional
def test_csrf_is_enforced(name, releaser):
    alias = "default"
    hold(alias, name)
    token = locks[alias].get(name).fencing_token
    client = logged_in(releaser, enforce_csrf_checks=True)
    data = {"lock": confirm_value(alias, name, token), "post": "yes"}
    assert client.post(reverse(RELEASE_URL), data).status_code == 403
    assert (
        client.post(
            list_url(),
            {"action": "release_selected", "_selected_action": [json.dumps([alias, name])]},
        ).status_code
        == 403
    )
    assert client.post(reverse(CLEAR_URL), {"post": "yes"}).status_code == 403
    assert locks[alias].get(name) is not None
    # With the token of the confirmation page's form, it goes through.
    page = client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])})
    csrf = page.context["csrf_token"]
    response = client.post(reverse(RELEASE_URL), {**data, "csrfmiddlewaretoken": str(csrf)})
    assert response.status_code == 302
    assert locks[alias].get(name) is None


@transactional
@pytest.mark.parametrize(
    "value",
    [
        "not json",
        json.dumps(["no-such-backend", "x", 1]),
        json.dumps(["default", "", 1]),
        json.dumps(["default", "a\x00b", 1]),
        json.dumps(["default", "x" * 201, 1]),
        json.dumps(["default", "x", "1"]),
        json.dumps(["default", "x"]),
        json.dumps({"alias": "default"}),
    ],
)
def test_invalid_selections_are_rejected(value, releaser):
    client = logged_in(releaser)
    assert client.post(reverse(RELEASE_URL), {"lock": value, "post": "yes"}).status_code == 400
    assert not LogEntry.objects.exists()


@transactional
def test_release_with_nothing_selected(releaser):
    response = logged_in(releaser).post(list_url(), {"action": "release_selected"}, follow=True)
    assert response.status_code == 200
    assert "Items must be selected" in response.content.decode()


# -- escaping --------------------------------------------------------------------------


@transactional
def test_names_are_escaped_everywhere(alias, releaser):
    name = XSS
    hold(alias, name, guards="<b>guard</b>")
    token = locks[alias].get(name).fencing_token
    client = logged_in(releaser)

    for response in (
        client.get(list_url()),
        client.get(list_url(q="script")),
        client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])}),
    ):
        content = response.content.decode()
        assert response.status_code == 200
        assert XSS not in content
        assert XSS_ESCAPED in content
        assert "<b>guard</b>" not in content

    content = confirmed_release(client, alias, name, token)
    assert locks[alias].get(name) is None
    assert "Force-released 1 lock" in content
    assert XSS not in content
    assert XSS_ESCAPED in content
    # The admin index's "Recent actions" shows the LogEntry, escaped too.
    content = client.get(reverse("admin:index")).content.decode()
    assert XSS not in content


@transactional
def test_bidi_and_control_characters_cannot_reorder_the_page(alias, releaser):
    # A name built from a URL may end in RIGHT-TO-LEFT OVERRIDE (U+202E) with no
    # closing PDF: raw, it made the browser show the rest of the confirmation line
    # (fencing token, owner) and of the success message reversed. Shown escaped, and
    # isolated (<bdi>; bidi isolates in messages) against right-to-left letters.
    name = "a\u202eevil\u2028\x85"
    hold(alias, name)
    token = locks[alias].get(name).fencing_token
    client = logged_in(releaser)
    shown = "a\\u202eevil\\u2028\\x85"
    marked = (
        'a<span class="setnx-escaped" title="U+202E">\\u202e</span>evil'
        '<span class="setnx-escaped" title="U+2028">\\u2028</span>'
        '<span class="setnx-escaped" title="U+0085">\\x85</span>'
    )
    for response in (
        client.get(list_url()),
        client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])}),
    ):
        content = response.content.decode()
        assert response.status_code == 200
        assert "\u202e" not in content and "\u2028" not in content and "\x85" not in content
        assert f"<bdi>{marked}</bdi>" in content
    content = confirmed_release(client, alias, name, token)
    assert locks[alias].get(name) is None
    assert f"Force-released 1 lock: {alias}: \u2068{shown}\u2069." in content
    assert "\u202e" not in content
    entry = LogEntry.objects.latest("pk")
    assert entry.object_repr == f"{alias}: {shown}"


@transactional
def test_a_real_control_character_and_its_typed_escape_look_different(alias, viewer):
    """A name holding a real newline and one typed with a backslash and an ``n`` both
    read ``a\\nb`` (the admin keeps backslashes as typed, for the search box), but
    only the real one is marked as an escape; HTML in a name with an escape is still
    escaped, marked safe by its caller or not."""
    prefix = f"marked:{uuid.uuid4().hex[:8]}:"
    real, typed = f"{prefix}a\nb", f"{prefix}a\\nb"
    hostile = mark_safe(f"{prefix}<i>x</i>\n<script>")
    for name in (real, typed, hostile):
        hold(alias, name)
    content = logged_in(viewer).get(list_url(q=prefix)).content.decode()
    assert f'<bdi>{prefix}a<span class="setnx-escaped" title="U+000A">\\n</span>b</bdi>' in content
    assert f"<bdi>{prefix}a\\nb</bdi>" in content
    assert (
        f'<bdi>{prefix}&lt;i&gt;x&lt;/i&gt;<span class="setnx-escaped" title="U+000A">\\n</span>'
        "&lt;script&gt;</bdi>"
    ) in content
    assert "<i>x</i>" not in content


# -- listing: pagination, filters, search ------------------------------------------------


@transactional
def test_pagination(alias, viewer):
    prefix = f"page:{uuid.uuid4().hex[:8]}:"
    names = {f"{prefix}{i:03d}" for i in range(250)}
    for n in names:
        hold(alias, n)
    client = logged_in(viewer)
    pages = []
    for p in (1, 2, 3):
        response = client.get(list_url(backend=alias, p=p))
        assert response.status_code == 200
        pages.append(listed_names(response))
        page = response.context["page"]
        assert page.total == 250
        assert page.num_pages == 3
    assert [len(p) for p in pages] == [100, 100, 50]
    assert set(pages[0]) | set(pages[1]) | set(pages[2]) == names
    assert len(set(pages[0] + pages[1] + pages[2])) == 250
    # The paginator links to the other pages.
    content = client.get(list_url(backend=alias, p=2)).content.decode()
    assert f'href="?backend={alias}&amp;p=3"' in content
    # Past the end: an empty page, not an error.
    response = client.get(list_url(backend=alias, p=9))
    assert response.status_code == 200
    assert listed_names(response) == []
    assert client.get(list_url(backend=alias, p="x")).status_code == 200


@transactional
def test_pagination_across_backends(alias, other, viewer):
    prefix = f"across:{uuid.uuid4().hex[:8]}:"
    for i in range(70):
        hold(alias, f"{prefix}a{i:02d}")
        hold(other, f"{prefix}b{i:02d}")
    client = logged_in(viewer)
    first = client.get(list_url())
    second = client.get(list_url(p=2))
    assert first.context["page"].total == 140
    assert len(listed_names(first)) == 100 and len(listed_names(second)) == 40
    assert len(set(listed_names(first)) | set(listed_names(second))) == 140


@transactional
def test_filters_by_backend_and_state(alias, viewer):
    held, stale = f"held:{uuid.uuid4().hex}", f"stale:{uuid.uuid4().hex}"
    hold(alias, held)
    make_stale(alias, stale)
    client = logged_in(viewer)

    assert set(listed_names(client.get(list_url(backend=alias)))) == {held, stale}
    assert listed_names(client.get(list_url(backend=alias, state="held"))) == [held]
    assert listed_names(client.get(list_url(backend=alias, state="stale"))) == [stale]
    assert listed_names(client.get(list_url(backend=other_alias(alias)))) == []

    response = client.get(list_url(backend=alias))
    states = {row["name"]: row["state"] for row in response.context["rows"]}
    assert states == {held: "held", stale: "stale"}
    content = response.content.decode()
    assert 'id="changelist-filter"' in content
    assert "By backend" in content and "By state" in content
    # Unknown filter values are ignored with a note, not a server error.
    response = client.get(list_url(backend="nope", state="weird"))
    assert response.status_code == 200
    assert {held, stale} <= set(listed_names(response))


@transactional
def test_search(alias, viewer):
    tag = uuid.uuid4().hex[:8]
    report, email, odd = f"{tag}:report:1", f"{tag}:email:2", f"{tag}:odd[x]*?\\:3"
    for n in (report, email, odd):
        hold(alias, n)
    client = logged_in(viewer)

    def search(q):
        return sorted(listed_names(client.get(list_url(backend=alias, q=q))))

    assert search("report") == [report]
    assert search(f"{tag}:e") == [email]
    assert search(f"{tag}:*:2") == [email]  # a glob: the whole name
    assert search("email") == [email]
    assert search("emai?") == []  # a glob must match the whole name
    assert search("[x]") == [odd]  # metacharacters are literal in a substring
    assert search("x]*?\\") == [odd]  # a malformed glob (a lone \\ at the end): text as typed
    assert search("*x]*?\\*") == []  # a glob ending in a literal star: no name does
    assert search("*x]\\*\\?\\\\*") == [odd]  # a glob, for the whole name
    assert search("*:odd\\[x]\\*\\?\\\\:3") == [odd]  # a glob with escapes
    assert search(tag) == sorted([report, email, odd])
    assert search("nothing-like-this") == []


@transactional
def test_hostile_search_patterns_answer_promptly(alias, viewer):
    """A user with only the view permission searches for patterns that made a
    backtracking regex engine take exponential time (45 s for one 67-character name
    on SQLite). The glob matcher is linear: each page answers at once, correctly."""
    tag = uuid.uuid4().hex[:8]
    long_names = [f"{tag}:" + "a" * 60 + str(i) for i in range(3)]
    for n in long_names:
        hold(alias, n)
    client = logged_in(viewer)
    for pattern in [
        "*?*?*?*?*?*?*?*?#",
        "*a*a*a*a*a*a*a*a*a*a*a*a*a*b",
        "?" * 500 + "*",
        f"{tag}:" + "*a" * 200 + "*",
    ]:
        response = client.get(list_url(backend=alias, q=pattern))
        assert response.status_code == 200
        assert listed_names(response) == [], pattern
    response = client.get(list_url(backend=alias, q=f"{tag}:" + "*a" * 20 + "*"))
    assert sorted(listed_names(response)) == sorted(long_names)
    # A malformed glob is a note, not a server error.
    response = client.get(list_url(backend=alias, q=f"{tag}[*"))
    assert response.status_code == 200
    assert "without a closing" in response.content.decode()


def test_search_to_glob():
    assert search_to_glob("") is None
    assert search_to_glob("a.b") == "*a.b*"
    assert search_to_glob("a[b]\\") == "*a\\[b\\]\\\\*"
    assert search_to_glob("a*") == "a*"


# -- clear stale -----------------------------------------------------------------------


@transactional
def test_clear_stale_only_removes_stale_locks(alias, releaser):
    held, stale = f"held:{uuid.uuid4().hex}", f"stale:{uuid.uuid4().hex}"
    hold(alias, held)
    make_stale(alias, stale)
    client = logged_in(releaser)

    content = client.get(list_url(backend=alias)).content.decode()
    assert reverse(CLEAR_URL) in content
    response = client.get(reverse(CLEAR_URL), {"backend": alias})
    assert response.status_code == 200
    assert response.context["backends"] == [{"alias": alias, "count": 1}]
    assert locks[alias].get(stale) is not None  # nothing happens before the POST

    response = client.post(reverse(CLEAR_URL), {"backend": alias, "post": "yes"}, follow=True)
    assert response.status_code == 200
    assert "Cleared 1 stale lock" in response.content.decode()
    assert locks[alias].get(stale) is None
    assert locks[alias].get(held) is not None
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION
    assert entry.object_repr == f"{alias}: 1 stale lock"
    assert stale in entry.get_change_message()


@transactional
def test_clear_stale_of_every_backend(releaser):
    aliases = list(settings.CONTRACT_ALIASES)
    for a in aliases:
        make_stale(a, f"stale:{a}")
        hold(a, f"held:{a}")
    client = logged_in(releaser)
    assert client.get(reverse(CLEAR_URL)).status_code == 200
    client.post(reverse(CLEAR_URL), {"post": "yes"})
    for a in aliases:
        assert locks[a].get(f"stale:{a}") is None
        assert locks[a].get(f"held:{a}") is not None
    assert client.post(reverse(CLEAR_URL), {"backend": "nope", "post": "yes"}).status_code == 400


# -- an unreachable backend ---------------------------------------------------------------


@transactional
def test_unreachable_backend_shows_an_error_row(name, viewer):
    hold("default", name)
    broken = {
        "default": settings.SETNX_LOCKS["default"],
        "down": {
            "BACKEND": "django_setnx.backends.redis.RedisBackend",
            "LOCATION": "redis://127.0.0.1:1/0",
            "OPTIONS": {"CONNECTION_KWARGS": {"socket_connect_timeout": 1}},
        },
    }
    with override_settings(SETNX_LOCKS=broken):
        response = logged_in(viewer).get(list_url())
        assert response.status_code == 200
        content = response.content.decode()
        assert "Lock backend down could not be read" in content
        assert name in listed_names(response)
        # Sorted, with counts: the same error row; no count where one is missing.
        response = logged_in(viewer).get(list_url(o="-1", _facets="True"))
        assert response.status_code == 200
        assert "Lock backend down could not be read" in response.content.decode()
        assert listed_names(response) == [name]
        assert choice_labels(response, "backend") == ["All", "default (1)", "down"]
        assert choice_labels(response, "state") == ["All", "Held", "Stale"]
    locks.reset()


# -- actions answered as a native changelist answers them --------------------------------


def query_of(url):
    """``(path, {param: value})`` of a URL (one value per param)."""
    parts = urlsplit(url)
    return parts.path, dict(parse_qsl(parts.query, keep_blank_values=True))


def message_texts(response):
    return [str(m) for m in response.context["messages"]]


@transactional
@pytest.mark.parametrize("action", ["", "no_such_action"])
def test_go_without_a_known_action_warns_and_keeps_the_list(alias, name, releaser, action):
    hold(alias, name)
    listed = {"backend": alias, "state": "held", "q": name[-6:], "o": "-5", "p": "1"}
    client = logged_in(releaser)
    response = client.post(
        list_url(**listed),
        {"action": action, "index": "0", "_selected_action": [json.dumps([alias, name])]},
    )
    assert response.status_code == 302
    assert query_of(response["Location"]) == (reverse(LIST_URL), listed)
    page = client.get(response["Location"])
    assert message_texts(page) == ["No action selected."]
    assert name in listed_names(page)
    assert locks[alias].get(name) is not None
    assert not LogEntry.objects.exists()


@transactional
def test_go_with_nothing_ticked_warns_and_keeps_the_list(releaser):
    listed = {"state": "stale", "q": "report"}
    client = logged_in(releaser)
    for action in ("release_selected", ""):
        response = client.post(list_url(**listed), {"action": action, "index": "0"})
        assert response.status_code == 302
        assert query_of(response["Location"]) == (reverse(LIST_URL), listed)
        assert message_texts(client.get(response["Location"])) == [
            "Items must be selected in order to perform actions on them. No items have "
            "been changed."
        ]


@transactional
def test_action_warnings_are_django_s_own_translations(name, releaser):
    hold("default", name)
    client = logged_in(releaser)
    with translation.override("fr"):
        response = client.post(
            list_url(),
            {"action": "", "_selected_action": [json.dumps(["default", name])]},
            follow=True,
        )
        assert message_texts(response) == ["Aucune action sélectionnée."]
        response = client.post(list_url(), {"action": "release_selected"}, follow=True)
        assert message_texts(response) == [
            "Des éléments doivent être sélectionnés afin d’appliquer les actions. Aucun "
            "élément n’a été modifié."
        ]


# -- the list's filters survive an action ------------------------------------------------


def form_action(response, marker):
    """The ``action`` URL of the page's form that contains ``marker``."""
    content = response.content.decode()
    form = next(f for f in content.split("<form")[1:] if marker in f)
    return html.unescape(form.split('action="', 1)[1].split('"', 1)[0])


def link_href(response, css_class):
    content = response.content.decode()
    anchor = content.split(f'class="{css_class}"', 1)[0].rsplit("<a ", 1)[1]
    return html.unescape(anchor.split('href="', 1)[1].split('"', 1)[0])


@transactional
def test_force_release_comes_back_to_the_same_list(alias, releaser):
    tag = uuid.uuid4().hex[:8]
    names = [f"{tag}:{i}" for i in range(3)]
    for n in names:
        hold(alias, n)
    listed = {"backend": alias, "state": "held", "q": tag, "o": "-1", "p": "1"}
    client = logged_in(releaser)
    confirmation = client.post(
        list_url(**listed),
        {
            "action": "release_selected",
            "index": "0",
            "_selected_action": [json.dumps([alias, names[0]])],
        },
    )
    assert confirmation.status_code == 200
    preserved = {"_changelist_filters": urlencode(listed)}
    # "No, take me back" goes back to the list as it was.
    assert query_of(link_href(confirmation, "button cancel-link")) == (reverse(LIST_URL), listed)
    # "Yes, I'm sure" posts the list's query string along, and ends on that list.
    action = form_action(confirmation, 'name="post"')
    assert query_of(action) == (reverse(RELEASE_URL), preserved)
    token = locks[alias].get(names[0]).fencing_token
    response = client.post(action, {"lock": confirm_value(alias, names[0], token), "post": "yes"})
    assert response.status_code == 302
    assert query_of(response["Location"]) == (reverse(LIST_URL), listed)
    assert locks[alias].get(names[0]) is None
    page = client.get(response["Location"])
    assert listed_names(page) == [names[2], names[1]]
    assert "Force-released 1 lock" in page.content.decode()
    # The confirmation page reached by GET keeps the list the same way.
    confirmation = client.get(
        reverse(RELEASE_URL), {"lock": json.dumps([alias, names[1]]), **preserved}
    )
    assert query_of(link_href(confirmation, "button cancel-link")) == (reverse(LIST_URL), listed)
    assert query_of(form_action(confirmation, 'name="post"')) == (reverse(RELEASE_URL), preserved)


@transactional
def test_clear_stale_comes_back_to_the_same_list(alias, releaser):
    tag = uuid.uuid4().hex[:8]
    make_stale(alias, f"{tag}:stale")
    hold(alias, f"{tag}:held")
    listed = {"backend": alias, "q": tag, "o": "3", "p": "1"}
    client = logged_in(releaser)
    page = client.get(list_url(**listed))
    clear_link = page.context["clear_url"]
    assert query_of(clear_link) == (
        reverse(CLEAR_URL),
        {"backend": alias, "_changelist_filters": urlencode(listed)},
    )
    confirmation = client.get(clear_link)
    assert confirmation.context["backends"] == [{"alias": alias, "count": 1}]
    assert query_of(link_href(confirmation, "button cancel-link")) == (reverse(LIST_URL), listed)
    action = form_action(confirmation, 'name="post"')
    assert query_of(action) == (reverse(CLEAR_URL), {"_changelist_filters": urlencode(listed)})
    response = client.post(action, {"backend": alias, "post": "yes"})
    assert response.status_code == 302
    assert query_of(response["Location"]) == (reverse(LIST_URL), listed)
    assert listed_names(client.get(response["Location"])) == [f"{tag}:held"]


# -- time zones -------------------------------------------------------------------------


def shown_time(moment_ms, zone):
    moment = datetime.datetime.fromtimestamp(moment_ms / 1000, tz=zone)
    return (
        f'<time datetime="{moment.isoformat(timespec="seconds")}">'
        f"{moment.replace(tzinfo=None).isoformat(' ', 'seconds')}</time>"
    )


@transactional
def test_times_are_in_the_current_time_zone_and_say_so(alias, name, releaser):
    hold(alias, name)
    info = locks[alias].get(name)
    with override_settings(USE_TZ=True, TIME_ZONE="Asia/Kathmandu"):
        client = logged_in(releaser)
        zone = zoneinfo.ZoneInfo("Asia/Kathmandu")
        content = client.get(list_url(backend=alias)).content.decode()
        assert (
            shown_time(info.acquired_at_ms, zone) + ' <span class="timezone">Asia/Kathmandu</span>'
        ) in content
        assert (
            shown_time(info.expires_at_ms, zone) + ' <span class="timezone">Asia/Kathmandu</span>'
        ) in content
        with timezone.override(zoneinfo.ZoneInfo("America/St_Johns")):
            content = client.get(
                reverse(RELEASE_URL), {"lock": json.dumps([alias, name])}
            ).content.decode()
        assert (
            shown_time(info.expires_at_ms, zoneinfo.ZoneInfo("America/St_Johns"))
            + ' <span class="timezone">America/St_Johns</span>'
        ) in content


@transactional
def test_times_are_utc_and_say_so_without_use_tz(alias, name, releaser):
    hold(alias, name)
    info = locks[alias].get(name)
    with override_settings(USE_TZ=False, TIME_ZONE="Asia/Kathmandu"):
        client = logged_in(releaser)
        utc = datetime.timezone.utc
        content = client.get(list_url(backend=alias)).content.decode()
        label = ' <span class="timezone">UTC</span>'
        assert shown_time(info.acquired_at_ms, utc) + label in content
        assert shown_time(info.expires_at_ms, utc) + label in content
        # Not one time in Kathmandu's local time (UTC+05:45, never equal to UTC's
        # digits). The zone's name itself may appear: Django 6.1's base template
        # names TIME_ZONE in the page.
        kathmandu = zoneinfo.ZoneInfo("Asia/Kathmandu")
        assert shown_time(info.acquired_at_ms, kathmandu) not in content
        assert shown_time(info.expires_at_ms, kathmandu) not in content
        content = client.get(
            reverse(RELEASE_URL), {"lock": json.dumps([alias, name])}
        ).content.decode()
        assert shown_time(info.expires_at_ms, utc) + label in content


@transactional
def test_an_absurd_expiry_written_by_hand_is_listed_not_a_crash(name, viewer):
    """A row whose expiry no backend could have written (past what ``datetime`` can
    hold) is listed as an unreadable, stale lock with its raw fields, in any time
    zone: the page never fails on it, and "clear stale" removes it."""
    LockRecord.objects.using("default").create(
        name=name, token="written-by-hand", owner="{}", acquired_at=0, expires_at=2**62
    )
    with override_settings(USE_TZ=True, TIME_ZONE="Asia/Kathmandu"):
        response = logged_in(viewer).get(list_url(backend="default"))
    assert response.status_code == 200
    assert listed_names(response) == [name]
    (row,) = response.context["rows"]
    assert row["state"] == "stale"
    assert str(2**62) in response.content.decode()


# -- sorting ------------------------------------------------------------------------------

#: The ``o`` column numbers (Django's: the action checkbox is column 0).
SORT_COLUMNS = {
    "name": 1,
    "backend": 2,
    "state": 3,
    "fencing_token": 5,
    "acquired_at": 6,
    "expires_at": 7,
}
#: Distinct even where a collation ignores case and accents (MySQL's unique index),
#: and in a different order by code point than by those collations.
WORDS = ["Bravo", "alpha", "élan", "Zeta", "yankee", "_under", "Échelle", "delta", "Ω", "ß"]


def sort_value(info, field):
    return {
        "name": info.name,
        "backend": info.backend,
        "state": info.state,
        "fencing_token": info.fencing_token,
        "acquired_at": info.acquired_at_ms,
        "expires_at": info.expires_at_ms,
    }[field]


def expected_order(infos, field, descending):
    """(backend, name) pairs sorted by ``field``, then name, then backend, ascending
    (Python's stable sort, applied from the last key to the first)."""
    ordered = sorted(infos, key=lambda i: (i.name, i.backend))
    ordered.sort(key=lambda i: sort_value(i, field), reverse=descending)
    return [(i.backend, i.name) for i in ordered]


def seed_sortable(alias, tag, count):
    """``count`` locks on ``alias`` with varied names, fencing tokens, times and
    states (every fourth one stale); returns their LockInfos."""
    names = [f"{tag}:{WORDS[i % len(WORDS)]}{i}" for i in range(count)]
    for i, n in enumerate(names):
        for _ in range(i % 3):  # some names acquired more often than others
            hold(alias, n).release()
        if i % 4 == 3:
            assert lock(n, ttl=0.05, backend=alias).acquire(blocking=False)
        else:
            hold(alias, n, ttl=100 + (i * 37) % 500)
    time.sleep(0.1)
    return [locks[alias].get(n) for n in names]


def listed_pairs(response):
    return [(row["backend"], row["name"]) for row in response.context["rows"]]


@transactional
def test_sorting_by_every_column_across_backends_and_pages(alias, other, viewer):
    tag = uuid.uuid4().hex[:6]
    infos = seed_sortable(alias, tag, 60) + seed_sortable(other, tag, 55)
    assert {i.state for i in infos} == {"held", "stale"}
    assert len({i.fencing_token for i in infos}) > 1
    client = logged_in(viewer)
    for field, column in SORT_COLUMNS.items():
        for descending in (False, True):
            o = f"-{column}" if descending else str(column)
            pages = [client.get(list_url(q=f"{tag}:*", o=o, p=p)) for p in (1, 2)]
            assert [r.context["page"].total for r in pages] == [115, 115]
            shown = listed_pairs(pages[0]) + listed_pairs(pages[1])
            assert shown == expected_order(infos, field, descending), (field, descending)
            assert "partly sorted" not in pages[0].content.decode()
            # One backend alone: its own page of the same order.
            alone = client.get(list_url(o=o, backend=alias, p=1))
            assert listed_pairs(alone) == expected_order(
                [i for i in infos if i.backend == alias], field, descending
            )


@transactional
def test_sort_by_two_columns(alias, viewer):
    tag = uuid.uuid4().hex[:6]
    infos = seed_sortable(alias, tag, 24)
    client = logged_in(viewer)
    # State descending (stale first), then fencing token ascending, then name.
    response = client.get(list_url(backend=alias, o="-3.5"))
    expected = sorted(infos, key=lambda i: (i.state != STALE, i.fencing_token, i.name))
    assert listed_pairs(response) == [(i.backend, i.name) for i in expected]


@transactional
def test_sortable_headers_use_django_s_markup_and_links(viewer):
    client = logged_in(viewer)
    response = client.get(list_url(state="held", o="6.-1", p="2"))
    headers = {h["text"]: h for h in response.context["headers"]}
    assert not headers["Owner"]["sortable"]
    acquired, name, backend = headers["Acquired at"], headers["Name"], headers["Backend"]
    assert acquired["class_attrib"] == "sortable column-acquired_at sorted ascending"
    assert [h["sort_priority"] for h in (acquired, name, backend)] == [1, 2, 0]
    assert name["class_attrib"] == "sortable column-name sorted descending"
    # As Django: a header link puts its column first (flipped if sorted), toggle flips
    # it in place, remove drops it; the page number is dropped, filters are kept.
    assert acquired["url_primary"] == "?state=held&o=-6.-1"
    assert name["url_primary"] == "?state=held&o=1.6"
    assert name["url_toggle"] == "?state=held&o=6.1"
    assert name["url_remove"] == "?state=held&o=6"
    assert backend["url_primary"] == "?state=held&o=2.6.-1"
    content = response.content.decode()
    assert '<th scope="col" class="sortable column-acquired_at sorted ascending">' in content
    assert '<a class="sortremove" href="?state=held&amp;o=-1"' in content
    assert 'class="toggle ascending" title="Toggle sorting"' in content
    assert '<span class="sortpriority" title="Sorting priority: 2">2</span>' in content
    # Unknown or unsortable columns in ``o`` are ignored, as Django ignores them.
    response = client.get(list_url(o="4.x.99.-2.2"))
    assert response.status_code == 200
    assert [h["sort_priority"] for h in response.context["headers"] if h["sortable"]] == [
        0,
        1,
        0,
        0,
        0,
        0,
    ]
    assert response.context["headers"][1]["ascending"] is False


def wait_for_a_stable_listing_order(alias):
    """Return once two listings of ``alias`` 0.2 s apart come in the same order.

    The unsorted rest of a partly sorted listing follows the backend's own order,
    which on Redis is SCAN's: the same from one page to the next unless Redis is
    resizing its key table, as it may be for a moment after many keys were added
    (its incremental rehash moves keys between SCAN positions)."""
    previous = None
    deadline = time.monotonic() + 10
    while True:
        order = [info.name for info in locks[alias].list()]
        if order == previous:
            return
        assert time.monotonic() < deadline, "the listing order keeps changing"
        previous = order
        time.sleep(0.2)


@transactional
def test_sorting_beyond_the_budget_is_partial_and_says_so(alias, other, viewer, monkeypatch):
    """Past SORT_LIMIT matching locks a streamed backend (Redis, local memory,
    Redlock) is sorted only partly, and the page says so: that many of its locks
    are merged into the order, the others follow on the next pages; every lock is
    listed once. The database always sorts in SQL, completely."""
    monkeypatch.setattr(paging, "SORT_LIMIT", 10)
    tag = uuid.uuid4().hex[:6]
    names = [f"{tag}:{i:03d}" for i in range(110)]
    for n in names:
        hold(alias, n)
    mine = [f"{tag}:x{i}" for i in range(5)]  # after every name above
    for n in mine:
        hold(other, n)
    wait_for_a_stable_listing_order(alias)
    client = logged_in(viewer)
    pages = [client.get(list_url(q=f"{tag}:*", o="-1", p=p)) for p in (1, 2)]
    shown = listed_names(pages[0]) + listed_names(pages[1])
    assert sorted(shown) == sorted(names + mine)
    assert [p.context["page"].has_next for p in pages] == [True, False]
    content = pages[0].content.decode()
    partial = not isinstance(locks[alias], DatabaseBackend)
    if not partial:
        assert shown == sorted(names + mine, reverse=True)
        assert "partly sorted" not in content
        return
    assert pages[0].context["page"].partially_sorted == [alias]
    assert f"Only partly sorted: the backend {alias} has more than 10" in content
    # The sorted part: the other backend's locks and ten of these, in order ...
    head = shown[:15]
    assert head == sorted(head, reverse=True)
    assert head[:5] == sorted(mine, reverse=True)
    # ... then the rest of these, in the backend's own order.
    assert set(shown[15:]) == set(names) - set(head)


# -- filter counts ("Show counts") --------------------------------------------------------


def choice_labels(response, title):
    spec = next(s for s in response.context["filter_specs"] if s["title"] == title)
    return [c["display"] for c in spec["choices"]]


@transactional
def test_filter_counts(alias, other, viewer):
    tag = uuid.uuid4().hex[:6]
    for i in range(3):
        hold(alias, f"{tag}:held{i}")
    make_stale(alias, f"{tag}:stale0")
    make_stale(alias, f"{tag}:stale1")
    hold(other, f"{tag}:held-other")
    hold(other, "unrelated")
    aliases = list(settings.SETNX_LOCKS)
    client = logged_in(viewer)

    def backend_counts(response):
        return dict(zip(["All", *aliases], choice_labels(response, "backend")))

    response = client.get(list_url())
    assert "(" not in "".join(choice_labels(response, "state"))
    assert "Show counts" in response.content.decode()

    response = client.get(list_url(_facets="True", q=tag))
    assert "Hide counts" in response.content.decode()
    assert choice_labels(response, "state") == ["All", "Held (4)", "Stale (2)"]
    counts = backend_counts(response)
    assert counts[alias] == f"{alias} (5)" and counts[other] == f"{other} (1)"
    # Each filter's counts apply the other filters (and the search), not itself.
    response = client.get(list_url(_facets="True", q=tag, backend=alias))
    assert choice_labels(response, "state") == ["All", "Held (3)", "Stale (2)"]
    assert backend_counts(response)[other] == f"{other} (1)"
    response = client.get(list_url(_facets="True", q=tag, state="stale"))
    counts = backend_counts(response)
    assert counts[alias] == f"{alias} (2)" and counts[other] == f"{other} (0)"
    assert choice_labels(response, "state") == ["All", "Held (4)", "Stale (2)"]
    # Links keep the counts on.
    assert all(
        "_facets=True" in c["query_string"]
        for s in response.context["filter_specs"]
        for c in s["choices"]
    )
    assert response.context["remove_counts_query"] == f"?state=stale&q={quote(tag)}"


@transactional
def test_costly_counts_are_left_out(alias, viewer, monkeypatch):
    """Past the budgets, a streamed backend's count is not shown (the page does not
    wait for it); the database's COUNT always is."""
    monkeypatch.setattr(paging, "COUNT_BUDGET", 2)
    monkeypatch.setattr(paging, "SORT_LIMIT", 2)
    tag = uuid.uuid4().hex[:6]
    for i in range(6):
        hold(alias, f"{tag}:{i}")
    response = logged_in(viewer).get(list_url(_facets="True", q=tag, backend=alias))
    assert response.status_code == 200
    if isinstance(locks[alias], DatabaseBackend):
        # COUNT in SQL: always shown.
        assert choice_labels(response, "state") == ["All", "Held (6)", "Stale (0)"]
    else:
        # More held locks than the budgets: not counted. No stale one: the stream
        # (or SCAN) ends at once, so that count is exact.
        assert choice_labels(response, "state") == ["All", "Held", "Stale (0)"]
    assert len(listed_names(response)) == 6


@transactional
def test_show_facets_setting_is_followed(name, viewer, monkeypatch):
    hold("default", name)
    model_admin = admin.site._registry[LockRecord]
    client = logged_in(viewer)
    if ShowFacets is None:
        # Django 4.2 has no facets (nor show_facets): counts on request, as ALLOW.
        response = client.get(list_url(backend="default"))
        assert choice_labels(response, "state") == ["All", "Held", "Stale"]
        assert "Show counts" in response.content.decode()
        response = client.get(list_url(backend="default", _facets="True"))
        assert choice_labels(response, "state") == ["All", "Held (1)", "Stale (0)"]
        assert "Hide counts" in response.content.decode()
        return
    monkeypatch.setattr(model_admin, "show_facets", ShowFacets.ALWAYS)
    response = client.get(list_url(backend="default"))
    assert choice_labels(response, "state") == ["All", "Held (1)", "Stale (0)"]
    assert "Show counts" not in response.content.decode()
    monkeypatch.setattr(model_admin, "show_facets", ShowFacets.NEVER)
    response = client.get(list_url(backend="default", _facets="True"))
    assert choice_labels(response, "state") == ["All", "Held", "Stale"]
    assert "Show counts" not in response.content.decode()


@transactional
@pytest.mark.parametrize("pg_alias", [a for a in settings.CONTRACT_ALIASES if a == "postgres"])
def test_names_sort_by_code_point_whatever_the_database_collation(pg_alias, viewer):
    """A PostgreSQL database created with a linguistic collation (en_US and the
    like: "alpha" before "Bravo") still sorts names as the other backends do, by
    code point, so that the merged order holds."""

    def set_collation(collation):
        with connections[pg_alias].cursor() as cursor:
            cursor.execute(
                "ALTER TABLE django_setnx_lock ALTER COLUMN name "
                f'TYPE varchar(200) COLLATE "{collation}"'
            )

    set_collation("en-x-icu")
    try:
        tag = uuid.uuid4().hex[:6]
        for word in WORDS:
            hold(pg_alias, f"{tag}:{word}")
        hold("locmem", f"{tag}:Charlie")
        client = logged_in(viewer)
        expected = sorted([f"{tag}:{w}" for w in WORDS])
        assert expected[:2] == [f"{tag}:Bravo", f"{tag}:Zeta"]
        assert listed_names(client.get(list_url(backend=pg_alias, o="1"))) == expected
        assert listed_names(client.get(list_url(q=f"{tag}:*", o="-1"))) == sorted(
            [*expected, f"{tag}:Charlie"], reverse=True
        )
    finally:
        locks["locmem"].clear(include_held=True)
        set_collation("default")
        # The backend's own connection planned its statements on the other collation.
        locks.reset()


def _write_unreadable(alias, name):
    """A record under ``name`` that no backend wrote (by hand, another tool): an
    owner that is not JSON, no fencing token, an expiry that is not a number."""
    backend = locks[alias]
    kind = type(backend).__name__
    if kind == "DatabaseBackend":
        with connections[backend.database].cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {LockRecord._meta.db_table} (name, token, owner, acquired_at, "
                "expires_at, fencing, next_token, next_since, next_seen) "
                "VALUES (%s, 'by-hand', 'not json', 0, %s, 0, '', 0, 0)",
                [name, 10**17],
            )
    else:
        from django_setnx.backends.redis import lock_keys

        backend.connection.client.hset(
            lock_keys(backend.key_prefix, name)[0], mapping={"token": "by-hand", "expires": "soon"}
        )


UNREADABLE_ALIASES = [
    a
    for a in settings.CONTRACT_ALIASES
    if settings.SETNX_LOCKS[a]["BACKEND"].endswith(("DatabaseBackend", "RedisBackend"))
]


@transactional
@pytest.mark.parametrize("unreadable_alias", UNREADABLE_ALIASES)
def test_an_unreadable_record_is_listed_and_can_be_force_released(
    unreadable_alias, releaser, force_released
):
    alias, name = unreadable_alias, f"by-hand:{uuid.uuid4().hex}"
    _write_unreadable(alias, name)
    client = logged_in(releaser)
    response = client.get(list_url(backend=alias, q=name))
    assert listed_names(response) == [name]
    response = client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])})
    assert [row["confirm_value"] for row in response.context["found"]] == [
        confirm_value(alias, name, 0)
    ]
    response = client.post(
        reverse(RELEASE_URL), {"lock": confirm_value(alias, name, 0), "post": "yes"}, follow=True
    )
    assert "Force-released 1 lock" in response.content.decode()
    assert locks[alias].get(name) is None
    assert LogEntry.objects.get().object_repr == f"{alias}: {name}"
    assert [sent["name"] for sent in force_released] == [name]


# -- any backend: the admin knows none of them ------------------------------------------------


@transactional
def test_a_third_party_backend_appears_with_no_admin_code(viewer, releaser, force_released):
    """A backend written against the base class alone (tests/dictbackend.py): the
    admin lists it, sorts it with the others, counts it and force-releases its
    locks, through BaseLockBackend.page(), get() and delete(fencing_token=)."""
    configured = {**settings.SETNX_LOCKS, "third": {"BACKEND": "tests.dictbackend.DictBackend"}}
    with override_settings(SETNX_LOCKS=configured):
        tag = uuid.uuid4().hex[:6]
        held = [hold("third", f"{tag}:b{i}") for i in range(3)]
        make_stale("third", f"{tag}:a-stale")
        hold("default", f"{tag}:c-default")
        client = logged_in(viewer)
        response = client.get(list_url(q=f"{tag}:*", backend="third", _facets="True"))
        assert listed_names(response) == [f"{tag}:a-stale", *(f"{tag}:b{i}" for i in range(3))]
        assert choice_labels(response, "state") == ["All", "Held (3)", "Stale (1)"]
        response = client.get(list_url(q=f"{tag}:*", o="-1"))
        assert listed_names(response) == [
            f"{tag}:c-default",
            *(f"{tag}:b{i}" for i in (2, 1, 0)),
            f"{tag}:a-stale",
        ]
        response = client.get(list_url(q=f"{tag}:*", state="stale", backend="third"))
        assert listed_names(response) == [f"{tag}:a-stale"]

        name = f"{tag}:b1"
        token = locks["third"].get(name).fencing_token
        # A stale fencing token releases nothing ...
        client = logged_in(releaser)
        response = client.post(
            reverse(RELEASE_URL),
            {"lock": confirm_value("third", name, token - 1), "post": "yes"},
            follow=True,
        )
        assert locks["third"].get(name).fencing_token == token
        assert force_released == []
        # ... the one shown does.
        response = client.post(
            reverse(RELEASE_URL),
            {"lock": confirm_value("third", name, token), "post": "yes"},
            follow=True,
        )
        assert "Force-released 1 lock" in response.content.decode()
        assert locks["third"].get(name) is None
        assert [(s["backend"], s["name"]) for s in force_released] == [("third", name)]
        assert LogEntry.objects.get().object_repr == f"third: {name}"
        for lk in held[::2]:
            lk.release()


# -- semaphores --------------------------------------------------------------------------


@transactional
def test_a_semaphore_is_one_heading_with_its_holders(alias, releaser, force_released):
    tag = uuid.uuid4().hex[:8]
    name = f"{tag}:exports"
    holders = [semaphore(name, 5, ttl=300, backend=alias, guards=f"export {i}") for i in range(3)]
    assert all(sem.acquire(blocking=False) for sem in holders)
    client = logged_in(releaser)
    response = client.get(list_url(q=tag, backend=alias))
    rows = response.context["rows"]
    assert rows[0] == {"semaphore": name, "backend": alias, "held": 3, "limit": 5}
    assert sorted(row["name"] for row in rows[1:]) == sorted(
        f"{name} [slot {sem.slot}/5]" for sem in holders
    )
    content = response.content.decode()
    assert "3/5 held" in content and content.count('class="semaphore-heading"') == 1

    # Force-release one holder: only its slot goes, fencing-checked.
    victim = holders[1]
    record = victim.info()
    response = client.post(
        reverse(RELEASE_URL),
        {"lock": confirm_value(alias, record.name, record.fencing_token), "post": "yes"},
        follow=True,
    )
    # The message names the slot as people read it, not by its record (r144).
    assert f"Force-released 1 lock: {alias}: \u2068{name} [slot {victim.slot}]\u2069." in (
        response.content.decode()
    )
    assert not victim.owned() and holders[0].owned() and holders[2].owned()
    assert LogEntry.objects.get().object_repr == f"{alias}: {name} [slot {victim.slot}/5]"
    assert [sent["name"] for sent in force_released] == [record.name]
    response = client.get(list_url(q=tag, backend=alias))
    assert response.context["rows"][0]["held"] == 2
    for sem in (holders[0], holders[2]):
        sem.release()
