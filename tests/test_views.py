"""``@locked`` on views the way Django projects write them: class-based views through
``method_decorator``, Django REST framework views, streaming responses, content
negotiation of the 409, ``Retry-After``, and the methods that are not locked.

Every view is served by Django's test client through the URLconf below, with and
without another holder of the lock.
"""

import asyncio
import json
import time

import django
import pytest
from django.http import FileResponse, HttpResponse, StreamingHttpResponse
from django.test import AsyncClient, Client
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.cache import never_cache
from rest_framework.decorators import api_view, renderer_classes
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from django_setnx import lock, locked, locks

pytestmark = [pytest.mark.autocommit, pytest.mark.urls("tests.test_views")]

BACKEND = "locmem"  # one process: the client and the views share it


def held(name):
    info = locks[BACKEND].get(name)
    return info is not None and info.is_held


def released_soon(name, within=2.0):
    """A collected response's lock is released by the releaser thread, not by the
    garbage collector itself: wait for it."""
    import time

    deadline = time.monotonic() + within
    while held(name) and time.monotonic() < deadline:
        time.sleep(0.005)
    return not held(name)


# -- class-based views ----------------------------------------------------------------

SEEN = {}


@method_decorator(locked("cbv:{request.path}", backend=BACKEND), name="dispatch")
class DispatchLocked(View):
    def get(self, request, slug):
        SEEN["dispatch"] = held(f"cbv:{request.path}")
        return HttpResponse(f"got {slug}")


class HandlerLocked(View):
    @method_decorator(locked("cbv-get:{slug}", backend=BACKEND))
    def get(self, request, slug):
        SEEN["get"] = held(f"cbv-get:{slug}")
        return HttpResponse(f"got {slug}")


@method_decorator(locked("acbv:{request.path}", backend=BACKEND), name="dispatch")
class AsyncDispatchLocked(View):
    """An async class-based view locked on ``dispatch``, which is sync and returns
    the handler's coroutine: the lock must be held while that coroutine runs."""

    running = 0
    most = 0

    async def post(self, request):
        cls = type(self)
        cls.running += 1
        cls.most = max(cls.most, cls.running)
        SEEN["async_dispatch"] = await locks[BACKEND].aget(f"acbv:{request.path}")
        await asyncio.sleep(0.05)
        cls.running -= 1
        return HttpResponse("paid")


@method_decorator([locked("list:{slug}", backend=BACKEND), never_cache], name="dispatch")
class ListDecorated(View):
    """Django's documented list form, with @locked not last."""

    def get(self, request, slug):
        SEEN["list"] = held(f"list:{slug}")
        return HttpResponse("ok")


class ListOnHandler(View):
    @method_decorator([locked("list-get:{slug}", backend=BACKEND), never_cache])
    def get(self, request, slug):
        SEEN["list_get"] = held(f"list-get:{slug}")
        return HttpResponse("ok")


class AsyncHandlerLocked(View):
    @method_decorator(locked("cbv-post:{slug}", backend=BACKEND, retry_after=7))
    async def post(self, request, slug):
        return HttpResponse("posted")


class AsyncHandlerLockedDirectly(View):
    """The same without method_decorator: what Django 4.2 needs (its
    method_decorator makes an async method sync, so the view stops being async)."""

    @locked("cbv-post:{slug}", backend=BACKEND, retry_after=7)
    async def post(self, request, slug):
        return HttpResponse("posted")


@method_decorator(locked("opts:{request.path}", backend=BACKEND), name="dispatch")
class OptionsOverridden(View):
    """Its own options() runs project code: OPTIONS takes the lock like any method."""

    def get(self, request):
        return HttpResponse("got")

    def options(self, request, *args, **kwargs):
        SEEN["options_ran"] = True
        return super().options(request, *args, **kwargs)


class Unlocked(View):
    def get(self, request):
        return HttpResponse("got")


@method_decorator(never_cache, name="dispatch")
class UnlockedNeverCache(View):
    """A method_decorator on dispatch leaves a ``__wrapped__`` that as_view() copies."""

    def get(self, request):
        return HttpResponse("got")


@method_decorator(locked("own-dispatch:{request.path}", backend=BACKEND), name="dispatch")
class OwnDispatch(View):
    def dispatch(self, request, *args, **kwargs):
        SEEN["own_dispatch"] = request.method
        return super().dispatch(request, *args, **kwargs)

    def get(self, request):
        return HttpResponse("got")


# -- Django REST framework --------------------------------------------------------------


@method_decorator(locked("api-dispatch:{request.path}", backend=BACKEND), name="dispatch")
class ApiDispatchLocked(APIView):
    renderer_classes = [JSONRenderer]

    def get(self, request):
        return Response({"ok": True})


class ApiLocked(APIView):
    renderer_classes = [JSONRenderer]

    @locked("api:{pk}", backend=BACKEND)
    def post(self, request, pk):
        SEEN["api_owner"] = locks[BACKEND].get(f"api:{pk}").owner
        return Response({"ok": pk})


@api_view(["POST"])
@renderer_classes([JSONRenderer])
@locked("api-fn:{pk}", backend=BACKEND)
def api_function(request, pk):
    SEEN["api_fn_owner"] = locks[BACKEND].get(f"api-fn:{pk}").owner
    return Response({"ok": pk})


# -- streaming, negotiation, methods ----------------------------------------------------


@locked("stream:{n}", backend=BACKEND)
def streaming(request, n):
    def chunks():
        for i in range(int(n)):
            SEEN.setdefault("stream", []).append(held(f"stream:{n}"))
            yield f"{i},"

    return StreamingHttpResponse(chunks())


@locked("async-stream:{n}", backend=BACKEND)
async def async_streaming(request, n):
    async def chunks():
        for i in range(int(n)):
            SEEN.setdefault("async_stream", []).append(held(f"async-stream:{n}"))
            await asyncio.sleep(0)
            yield f"{i},"

    return StreamingHttpResponse(chunks())


@locked("file:{n}", backend=BACKEND)
def file_download(request, n, tmp=None):
    import io

    return FileResponse(io.BytesIO(b"x" * 10_000), filename="x.bin")


@locked("etag", backend=BACKEND)
def etag_stream(request):
    response = StreamingHttpResponse(iter([b"a", b"b"]))
    response["ETag"] = '"v1"'
    return response


@locked("plain:{n}", backend=BACKEND)
def plain(request, n):
    SEEN["plain"] = held(f"plain:{n}")
    return HttpResponse("ok")


@locked("skip:{n}", backend=BACKEND, on_contention="skip")
def skipping(request, n):
    return HttpResponse("ran")


@locked("fixed:{n}", backend=BACKEND, ttl=30, retry_after=5)
def fixed_retry(request, n):
    return HttpResponse("ok")


@locked("slug:{slug}", backend=BACKEND)
def by_slug(request, slug):
    return HttpResponse("ok")


@locked("sem:{slug}", backend=BACKEND, limit=5)
def sem_by_slug(request, slug):
    return HttpResponse("ok")


class ApiBySlug(APIView):
    @locked("api-slug:{slug}", backend=BACKEND)
    def get(self, request, slug):
        return Response({"ok": True})


@locked("auser:{request.user.pk}", backend=BACKEND)
async def async_by_user(request):
    """Review r126: an async view whose lock name reads the session's user (a query)."""
    SEEN["async_user"] = held(f"auser:{request.user.pk}")
    return HttpResponse("user ok")


@method_decorator(locked("self:{self.kwargs[slug]}", backend=BACKEND), name="dispatch")
class SelfLocked(View):
    """Review r126: a template naming the view instance through method_decorator."""

    def get(self, request, slug):
        SEEN["self"] = held(f"self:{slug}")
        return HttpResponse("self ok")

    @method_decorator(locked("self-post:{self.kwargs[slug]}", backend=BACKEND))
    def post(self, request, slug):
        SEEN["self_post"] = held(f"self-post:{slug}")
        return HttpResponse("self post ok")


def _without_wraps(method):
    """A decorator that keeps no signature: the method becomes (*args, **kwargs)."""

    def inner(*args, **kwargs):
        return method(*args, **kwargs)

    return inner


class NoWraps(View):
    """Review r129: under method_decorator, a handler of (*args, **kwargs) lost its
    first positional argument (the request) as if it were the instance."""

    @method_decorator(locked("nw:{slug}", backend=BACKEND))
    @_without_wraps
    def get(self, request, slug):
        SEEN["no_wraps"] = held(f"nw:{slug}")
        return HttpResponse("no wraps ok")


urlpatterns = [
    path("nw/<slug:slug>/", NoWraps.as_view()),
    path("auser/", async_by_user),
    path("self/<slug:slug>/", SelfLocked.as_view()),
    path("slug/<str:slug>/", by_slug),
    path("api-slug/<str:slug>/", ApiBySlug.as_view()),
    path("sem-slug/<str:slug>/", sem_by_slug),
    path("cbv/<slug:slug>/", DispatchLocked.as_view()),
    path("cbv-get/<slug:slug>/", HandlerLocked.as_view()),
    path("cbv-async/<slug:slug>/", AsyncHandlerLocked.as_view()),
    path("cbv-async-direct/<slug:slug>/", AsyncHandlerLockedDirectly.as_view()),
    path("acbv/", AsyncDispatchLocked.as_view()),
    path("list/<slug:slug>/", ListDecorated.as_view()),
    path("list-get/<slug:slug>/", ListOnHandler.as_view()),
    path("api/<int:pk>/", ApiLocked.as_view()),
    path("api-fn/<int:pk>/", api_function),
    path("stream/<int:n>/", streaming),
    path("async-stream/<int:n>/", async_streaming),
    path("file/<int:n>/", file_download),
    path("plain/<int:n>/", plain),
    path("etag/", etag_stream),
    path("skip/<int:n>/", skipping),
    path("fixed/<int:n>/", fixed_retry),
    path("opts/", OptionsOverridden.as_view()),
    path("as-view/", locked("as-view:{request.path}", backend=BACKEND)(Unlocked.as_view())),
    path("api-dispatch/", ApiDispatchLocked.as_view()),
    path(
        "as-view-nc/",
        locked("as-view-nc:{request.path}", backend=BACKEND)(UnlockedNeverCache.as_view()),
    ),
    path("own-dispatch/", OwnDispatch.as_view()),
]


@pytest.fixture(autouse=True)
def _fresh():
    SEEN.clear()
    yield
    locks[BACKEND].clear(include_held=True)


def test_method_decorator_on_dispatch():
    client = Client()
    response = client.get("/cbv/a/")
    assert response.status_code == 200 and response.content == b"got a"
    assert SEEN["dispatch"] is True
    assert not held("cbv:/cbv/a/")
    with lock("cbv:/cbv/a/", ttl=30, backend=BACKEND):
        response = client.get("/cbv/a/")
    assert response.status_code == 409 and int(response["Retry-After"]) >= 1


def test_method_decorator_on_a_handler_method():
    client = Client()
    assert client.get("/cbv-get/b/").status_code == 200
    assert SEEN["get"] is True
    with lock("cbv-get:b", ttl=30, backend=BACKEND):
        assert client.get("/cbv-get/b/").status_code == 409


@pytest.mark.parametrize(
    "route",
    [
        # Django 5.0+ keeps an async method async through method_decorator.
        *(["cbv-async"] if django.VERSION >= (5, 0) else []),
        "cbv-async-direct",
    ],
)
def test_method_decorator_on_an_async_handler(route):
    client = AsyncClient()

    async def post():
        return await client.post(f"/{route}/c/")

    assert asyncio.run(post()).status_code == 200
    with lock("cbv-post:c", ttl=30, backend=BACKEND):
        response = asyncio.run(post())
    assert response.status_code == 409 and response["Retry-After"] == "7"


def test_drf_api_view_answers_409_and_records_the_request():
    client = Client()
    response = client.post("/api/5/")
    assert response.status_code == 200 and response.json() == {"ok": 5}
    assert SEEN["api_owner"]["guards"].startswith("POST /api/5/ (")
    with lock("api:5", ttl=30, backend=BACKEND):
        response = client.post("/api/5/", HTTP_ACCEPT="application/json")
    assert response.status_code == 409
    body = response.json()
    assert body["retry_after"] >= 1 and "busy" in body["detail"]
    assert response["Retry-After"] == str(body["retry_after"])


def test_drf_function_view():
    client = Client()
    assert client.post("/api-fn/6/").status_code == 200
    assert SEEN["api_fn_owner"]["guards"].startswith("POST /api-fn/6/ (")
    with lock("api-fn:6", ttl=30, backend=BACKEND):
        response = client.post("/api-fn/6/")
    assert response.status_code == 409
    assert response["Content-Type"] == "application/json", "an API view answers JSON by default"


def test_streaming_response_is_streamed_under_the_lock():
    client = Client()
    response = client.get("/stream/4/")
    assert response.status_code == 200
    assert held("stream:4"), "the lock is held until the body has been sent"
    assert b"".join(response.streaming_content) == b"0,1,2,3,"
    assert SEEN["stream"] == [True, True, True, True]
    response.close()
    assert not held("stream:4")


def test_streaming_response_closed_early_releases():
    client = Client()
    response = client.get("/stream/100/")
    next(iter(response.streaming_content))
    assert held("stream:100")
    response.close()  # the client went away: the server closes the response
    assert not held("stream:100")


def test_async_streaming_response_is_streamed_under_the_lock():
    async def fetch():
        response = await AsyncClient().get("/async-stream/3/")
        body = b"".join([chunk async for chunk in response.streaming_content])
        return response, body

    response, body = asyncio.run(fetch())
    assert body == b"0,1,2,"
    assert SEEN["async_stream"] == [True, True, True]
    assert not held("async-stream:3")


def test_file_response_is_held_until_sent():
    response = Client().get("/file/1/")
    assert held("file:1")
    assert len(b"".join(response.streaming_content)) == 10_000
    response.close()
    assert not held("file:1")


def test_contention_response_negotiates_json_or_text():
    client = Client()
    with lock("plain:1", ttl=30, backend=BACKEND):
        as_json = client.get("/plain/1/", HTTP_ACCEPT="application/json")
        as_html = client.get("/plain/1/", HTTP_ACCEPT="text/html,application/xhtml+xml")
        as_any = client.get("/plain/1/", HTTP_ACCEPT="*/*")
    assert as_json.status_code == as_html.status_code == as_any.status_code == 409
    assert as_json["Content-Type"] == "application/json"
    assert json.loads(as_json.content)["retry_after"] == int(as_json["Retry-After"])
    assert as_html["Content-Type"].startswith("text/plain")
    assert as_any["Content-Type"].startswith("text/plain")


def test_retry_after_option_and_default():
    client = Client()
    with lock("fixed:1", ttl=60, backend=BACKEND):
        assert client.get("/fixed/1/")["Retry-After"] == "5"
    with lock("plain:2", ttl=40, backend=BACKEND):
        assert 38 <= int(client.get("/plain/2/")["Retry-After"]) <= 40


def test_a_function_view_takes_the_lock_for_every_method():
    """A function view runs its whole body for HEAD and OPTIONS too: serving them
    unlocked would let any client run it beside the holder."""
    client = Client()
    with lock("plain:3", ttl=30, backend=BACKEND):
        assert client.head("/plain/3/").status_code == 409
        assert client.options("/plain/3/").status_code == 409
        assert client.get("/plain/3/").status_code == 409
    assert "plain" not in SEEN, "the body never ran beside the holder"


@pytest.mark.parametrize(
    "url, lock_name",
    [
        ("/cbv/o/", "cbv:/cbv/o/"),  # method_decorator on dispatch
        ("/as-view/", "as-view:/as-view/"),  # @locked around as_view()
        ("/as-view-nc/", "as-view-nc:/as-view-nc/"),  # ... of a method_decorator'd view
        ("/own-dispatch/", "own-dispatch:/own-dispatch/"),  # project code in dispatch()
        ("/api-dispatch/", "api-dispatch:/api-dispatch/"),  # DRF: permissions, metadata
    ],
)
def test_every_method_of_a_class_based_view_takes_the_lock(url, lock_name):
    """OPTIONS too: what answers it may be project code (an overridden dispatch or
    options, a mixin, RedirectView's get_redirect_url, DRF's permissions), and
    nothing short of running the view tells."""
    client = Client()
    with lock(lock_name, ttl=30, backend=BACKEND):
        assert client.options(url).status_code == 409
        assert client.head(url).status_code == 409, "Django runs the GET code for HEAD"
        assert client.get(url).status_code == 409
    assert "own_dispatch" not in SEEN, "the project's dispatch() ran beside the holder"
    assert client.options(url).status_code == 200
    assert client.get(url).status_code == 200


def test_options_overridden_by_the_view_is_locked():
    client = Client()
    with lock("opts:/opts/", ttl=30, backend=BACKEND):
        assert client.options("/opts/").status_code == 409
    assert "options_ran" not in SEEN
    assert client.options("/opts/").status_code == 200 and SEEN["options_ran"]


def test_unlocked_methods_option():
    from django.test import RequestFactory

    ran = []

    @locked("opt:{request.path}", backend=BACKEND, unlocked_methods=("HEAD", "options"))
    def view(request):
        ran.append(request.method)
        return HttpResponse("ok")

    @locked("opt:{request.path}", backend=BACKEND, unlocked_methods=())
    def strict(request):
        return HttpResponse("ok")

    factory = RequestFactory()
    with lock("opt:/x/", ttl=30, backend=BACKEND):
        assert view(factory.head("/x/")).status_code == 200
        assert view(factory.options("/x/")).status_code == 200
        assert view(factory.get("/x/")).status_code == 409
        assert strict(factory.options("/x/")).status_code == 409
    assert ran == ["HEAD", "OPTIONS"]


def test_skip_on_a_view_answers_204():
    client = Client()
    assert client.get("/skip/1/").content == b"ran"
    with lock("skip:1", ttl=30, backend=BACKEND):
        response = client.get("/skip/1/")
    assert response.status_code == 204 and response.content == b""


def test_bad_retry_after_is_refused_at_decoration():
    from django.core.exceptions import ImproperlyConfigured

    for bad in (-1, "5", float("inf"), True):
        with pytest.raises(ImproperlyConfigured, match="retry_after"):
            locked("x", retry_after=bad)


def test_async_view_locked_on_dispatch_holds_the_lock_while_its_handler_runs():
    AsyncDispatchLocked.running = AsyncDispatchLocked.most = 0

    async def requests():
        client = AsyncClient()
        return await asyncio.gather(*(client.post("/acbv/") for _ in range(5)))

    responses = asyncio.run(requests())
    assert sorted(r.status_code for r in responses) == [200, 409, 409, 409, 409]
    assert AsyncDispatchLocked.most == 1
    assert SEEN["async_dispatch"] is not None and SEEN["async_dispatch"].is_held
    assert not held("acbv:/acbv/")


@pytest.mark.parametrize(
    "url, key, lock_name",
    [("/list/a/", "list", "list:a"), ("/list-get/b/", "list_get", "list-get:b")],
)
def test_method_decorator_list_with_locked_not_last(url, key, lock_name):
    client = Client()
    response = client.get(url)
    assert response.status_code == 200 and SEEN[key] is True
    assert "no-cache" in response["Cache-Control"] or "max-age=0" in response["Cache-Control"]
    with lock(lock_name, ttl=30, backend=BACKEND):
        assert client.get(url).status_code == 409


def test_a_streaming_response_dropped_unsent_releases():
    """A middleware that answers 304 instead drops the streaming response unsent:
    the lock goes with it, not at its ttl."""
    import gc

    from django.test import RequestFactory

    response = streaming(RequestFactory().get("/stream/5/"), "5")
    assert held("stream:5")
    del response
    gc.collect()
    assert released_soon("stream:5")


@pytest.mark.urls("tests.test_views")
def test_conditional_get_304_releases(settings):
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.http.ConditionalGetMiddleware"]
    import gc

    client = Client()
    response = client.get("/etag/", HTTP_IF_NONE_MATCH='"v1"')
    assert response.status_code == 304
    gc.collect()  # what dropped the streaming response may hold it in a reference cycle
    assert released_soon("etag")
    assert client.get("/etag/").status_code == 200


def test_file_response_keeps_its_file_for_sendfile():
    from django.test import RequestFactory

    response = file_download(RequestFactory().get("/file/2/"), "2")
    assert response.file_to_stream is not None, "sendfile (wsgi.file_wrapper) still works"
    assert held("file:2")
    response.close()
    assert not held("file:2")


@pytest.mark.parametrize("url", ["/slug/", "/api-slug/"])
@pytest.mark.parametrize("slug", ["x" * 300, "a%00b", "a%1Fb"])
def test_a_lock_name_from_the_url_that_no_lock_may_have_is_a_400(url, slug):
    """The client's input (too long for a name, a NUL, the slot separator): Django's
    BadRequest, not a 500, and nothing written."""
    client = Client()
    assert client.get(f"{url}fine/").status_code == 200
    response = client.get(f"{url}{slug}/")
    assert response.status_code == 400
    assert list(locks[BACKEND].list()) == []


def test_a_semaphore_name_from_the_url_without_room_for_its_slots_is_a_400():
    """Review r119: a semaphore's name must leave room for its slots' numbers; a name
    short enough for a lock but not for that is the client's input too."""
    client = Client()
    assert client.get("/sem-slug/fine/").status_code == 200
    assert client.get(f"/sem-slug/{'x' * 195}/").status_code == 400
    assert list(locks[BACKEND].list()) == []


def test_unlocked_methods_must_be_a_sequence_of_names():
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match="'OPTIONS'"):
        locked("x", unlocked_methods="OPTIONS")


def test_an_async_view_may_name_its_lock_from_the_logged_in_user():
    """Review r126: ``{request.user.pk}`` loads the session's user, a query, which
    Django refuses in an event loop: every logged-in request was a 500. The name is
    now built in a thread when it needs the database."""
    from django.contrib.auth.models import User

    user = User.objects.create_user("r126-async-user")
    try:
        client = AsyncClient()
        client.force_login(user)
        response = asyncio.run(client.get("/auser/"))
        assert response.status_code == 200 and SEEN["async_user"] is True
        assert not held(f"auser:{user.pk}")
        with lock(f"auser:{user.pk}", ttl=30, backend=BACKEND):
            assert asyncio.run(client.get("/auser/")).status_code == 409
        anonymous = asyncio.run(AsyncClient().get("/auser/"))
        assert anonymous.status_code == 200  # request.user.pk is None: "auser:None"
    finally:
        user.delete()


@pytest.mark.parametrize("method, name", [("get", "self:s1"), ("post", "self-post:s1")])
def test_a_template_may_name_the_view_instance_through_method_decorator(method, name):
    """Review r126: ``{self.kwargs[pk]}`` on dispatch (a ValueError) or on a handler
    (ImproperlyConfigured) failed every request: method_decorator passes the method
    bound, so ``self`` is not among the call's arguments; it is taken from the bound
    method."""
    client = Client()
    response = getattr(client, method)("/self/s1/")
    assert response.status_code == 200
    assert SEEN["self" if method == "get" else "self_post"] is True
    with lock(name, ttl=30, backend=BACKEND):
        assert getattr(client, method)("/self/s1/").status_code == 409


def test_a_handler_without_a_signature_is_locked_through_method_decorator():
    client = Client()
    assert client.get("/nw/x/").status_code == 200 and SEEN["no_wraps"] is True
    with lock("nw:x", ttl=30, backend=BACKEND):
        assert client.get("/nw/x/").status_code == 409


def test_a_recursive_async_call_whose_name_is_built_in_a_thread_is_refused():
    """Review r129: a name that needs the database is built in a thread (see the
    test above), and the re-entry check ran there too, where the caller's task is
    not the runner: the recursive call waited for its own lock (for ever, with
    timeout=None). The check runs in the loop."""
    from django.contrib.auth.models import User

    from django_setnx.exceptions import LockError

    def name_from_the_database(depth):
        return f"recursive:{User.objects.filter(pk=-1).count()}"  # a query

    @locked(name_from_the_database, backend=BACKEND, timeout=5)
    async def recurse(depth):
        if depth:
            return await recurse(depth - 1)
        return "done"

    started = time.monotonic()
    with pytest.raises(LockError, match="already held"):
        asyncio.run(recurse(1))
    assert time.monotonic() - started < 2
    assert asyncio.run(recurse(0)) == "done"
