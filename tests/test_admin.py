"""The admin's Locks page, with the Django test client, against the real backends.

Tests that take ``alias`` run once per backend of the contract suite (SQLite,
PostgreSQL and MariaDB/MySQL when reachable, Redis, local memory): the database
backend is read through SQL, Redis through SCAN, local memory through the generic
streaming ``list()``.

The tests are transactional (``transaction=True``): on SQLite the test's own
connection would otherwise hold the write lock (creating users) while the lock
backend's separate connection tries to write.
"""

import json
import time
import uuid
from urllib.parse import urlencode

import pytest
from django.conf import settings
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.test import Client, override_settings
from django.urls import reverse

from django_setnx import lock, locks
from django_setnx.admin_views import glob_to_sql_regex, search_to_glob
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
            Permission.objects.get(content_type__app_label="django_setnx", codename=codename))
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
    return [row["name"] for row in response.context["rows"]]


def confirm_value(alias, name, token):
    return json.dumps([alias, name, token])


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
    assert client.get(reverse(RELEASE_URL), {"lock": json.dumps(["default", name])}).status_code == 403
    assert client.get(reverse(CLEAR_URL)).status_code == 403
    response = client.post(reverse(RELEASE_URL), {
        "lock": confirm_value("default", name, locks["default"].get(name).fencing_token),
        "post": "yes"})
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
    assert client.post(list_url(), {"action": "release_selected",
                                    "_selected_action": [selection]}).status_code == 403
    assert client.get(reverse(RELEASE_URL), {"lock": selection}).status_code == 403
    assert client.post(reverse(RELEASE_URL), {
        "lock": confirm_value(alias, name, info), "post": "yes"}).status_code == 403
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
    response = client.post(list_url(), {"action": "release_selected",
                                        "_selected_action": [json.dumps([alias, name])]})
    assert response.status_code == 200
    assert "Are you sure" in response.content.decode()
    # ... which can also be reached with GET.
    response = client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])})
    assert response.status_code == 200
    content = response.content.decode()
    assert f"fencing token {token}" in content
    assert [row["confirm_value"] for row in response.context["found"]] == [
        confirm_value(alias, name, token)]
    assert locks[alias].get(name) is not None  # nothing happens before the POST

    response = client.post(reverse(RELEASE_URL), {
        "lock": confirm_value(alias, name, token), "post": "yes"}, follow=True)
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

    response = client.post(reverse(RELEASE_URL), {
        "lock": confirm_value(alias, name, shown), "post": "yes"}, follow=True)
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
    response = logged_in(releaser).post(reverse(RELEASE_URL), {
        "lock": confirm_value(alias, name, token), "post": "yes"}, follow=True)
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
    assert client.post(list_url(), {"action": "release_selected",
                                    "_selected_action": [json.dumps([alias, name])]}).status_code == 403
    assert client.post(reverse(CLEAR_URL), {"post": "yes"}).status_code == 403
    assert locks[alias].get(name) is not None
    # With the token of the confirmation page's form, it goes through.
    page = client.get(reverse(RELEASE_URL), {"lock": json.dumps([alias, name])})
    csrf = page.context["csrf_token"]
    response = client.post(reverse(RELEASE_URL), {**data, "csrfmiddlewaretoken": str(csrf)})
    assert response.status_code == 302
    assert locks[alias].get(name) is None


@transactional
@pytest.mark.parametrize("value", [
    "not json",
    json.dumps(["no-such-backend", "x", 1]),
    json.dumps(["default", "", 1]),
    json.dumps(["default", "a\x00b", 1]),
    json.dumps(["default", "x" * 201, 1]),
    json.dumps(["default", "x", "1"]),
    json.dumps(["default", "x"]),
    json.dumps({"alias": "default"}),
])
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

    response = client.post(reverse(RELEASE_URL), {
        "lock": confirm_value(alias, name, token), "post": "yes"}, follow=True)
    content = response.content.decode()
    assert locks[alias].get(name) is None
    assert "Force-released 1 lock" in content
    assert XSS not in content
    assert XSS_ESCAPED in content
    # The admin index's "Recent actions" shows the LogEntry, escaped too.
    content = client.get(reverse("admin:index")).content.decode()
    assert XSS not in content


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
def test_pagination_across_backends(alias, viewer):
    other = other_alias(alias)
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
    assert search(f"{tag}:*:2") == [email]          # a glob: the whole name
    assert search("email") == [email]
    assert search("emai?") == []                    # a glob must match the whole name
    assert search("[x]") == [odd]                   # metacharacters are literal in a substring
    assert search("x]*?\\") == []                   # has * and ?: a glob, for the whole name
    assert search("*:odd\\[x]\\*\\?\\\\:3") == [odd]  # a glob with escapes
    assert search(tag) == sorted([report, email, odd])
    assert search("nothing-like-this") == []


@transactional
def test_search_to_glob_and_sql_regex():
    assert search_to_glob("") is None
    assert search_to_glob("a.b") == "*a.b*"
    assert search_to_glob("a[b]\\") == "*a\\[b\\]\\\\*"
    assert search_to_glob("a*") == "a*"
    assert glob_to_sql_regex("a*b?c") == "^a.*b.c$"
    assert glob_to_sql_regex("x.[^ab]\\*") == "^x\\.[^ab]\\*$"


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
    assert entry.object_repr == f"{alias}: 1 stale locks"
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
    locks.reset()
