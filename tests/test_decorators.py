"""``@locked`` on functions, methods, async functions and views, on every backend."""

import asyncio
import time

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory
from django.utils.decorators import method_decorator
from django.views import View

from django_setnx import lock, locked
from django_setnx.exceptions import LockError, LockNotAcquired, LockNotOwned

# Decorated calls release after COMMIT when made inside a transaction; these tests
# check the plain (autocommit) behaviour, as a call outside any atomic block sees it.
pytestmark = pytest.mark.autocommit


def test_template_is_filled_from_arguments(alias, name):
    seen = {}

    @locked(name + ":invoice:{invoice_id}:{currency}", ttl=30, backend=alias)
    def charge(invoice_id, amount, currency="EUR"):
        info = lock(f"{name}:invoice:{invoice_id}:{currency}", backend=alias).info()
        seen["info"] = info
        return amount * 2

    assert charge(7, 21) == 42
    assert seen["info"].is_held
    assert (
        seen["info"]
        .owner["guards"]
        .endswith("test_template_is_filled_from_arguments.<locals>.charge")
    )
    assert lock(f"{name}:invoice:7:EUR", backend=alias).info() is None


def test_contention_policies(alias, name):
    calls = []

    def job(n):
        calls.append(n)
        return n

    raising = locked(name + ":{n}", backend=alias)(job)
    skipping = locked(name + ":{n}", backend=alias, on_contention="skip")(job)
    answering = locked(
        name + ":{n}", backend=alias, on_contention=lambda lk, n: f"busy {lk.name}"
    )(job)
    with lock(name + ":1", backend=alias):
        with pytest.raises(LockNotAcquired, match=f"{name}:1"):
            raising(1)
        assert skipping(1) is None
        assert answering(1) == f"busy {name}:1"
        assert raising(2) == 2  # another name is free
    assert calls == [2]


def test_lock_is_released_when_function_raises(alias, name):
    @locked(name, backend=alias)
    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        boom()
    assert not lock(name, backend=alias).locked()


def test_methods_and_attribute_lookups(alias, name):
    class Account:
        pk = 5

        @locked(name + ":account:{self.pk}", backend=alias)
        def close(self):
            return lock(f"{name}:account:5", backend=alias).locked()

    assert Account().close() is True


def test_callable_name(alias, name):
    @locked(lambda user_id: f"{name}:user:{user_id * 10}", backend=alias)
    def work(user_id):
        return lock(f"{name}:user:{user_id * 10}", backend=alias).locked()

    assert work(4) is True


def test_async_function(alias, name):
    @locked(name + ":{key}", backend=alias, ttl=30)
    async def work(key):
        await asyncio.sleep(0)
        return await lock(f"{name}:{key}", backend=alias).alocked()

    async def main():
        assert await work("a") is True
        async with lock(name + ":b", backend=alias):
            with pytest.raises(LockNotAcquired):
                await work("b")

    asyncio.run(main())


def test_view_contention_is_409_with_retry_after(alias, name):
    @locked(name + ":report:{pk}", ttl=30, backend=alias)
    def report(request, pk):
        return HttpResponse(f"report {pk}")

    request = RequestFactory().get("/reports/3/")
    assert report(request, pk=3).status_code == 200
    with lock(name + ":report:3", ttl=30, backend=alias):
        response = report(request, pk=3)
    assert response.status_code == 409
    assert 1 <= int(response["Retry-After"]) <= 30


def test_view_owner_records_method_and_path(alias, name):
    @locked(name, backend=alias)
    def view(request):
        return HttpResponse(lock(name, backend=alias).info().owner["guards"])

    body = view(RequestFactory().post("/checkout/")).content.decode()
    assert body.startswith("POST /checkout/ (tests.test_decorators.")


def test_a_class_based_view_owner_names_its_own_class(alias, name):
    """Through method_decorator on an inherited ``dispatch``, the owner record names
    the view's class, not the base class that defines ``dispatch``."""

    @method_decorator(locked(name, backend=alias), name="dispatch")
    class InvoiceView(View):
        def post(self, request):
            return HttpResponse(lock(name, backend=alias).info().owner["guards"])

    body = InvoiceView.as_view()(RequestFactory().post("/invoices/")).content.decode()
    assert body.startswith("POST /invoices/ (tests.test_decorators.")
    assert body.endswith("InvoiceView.dispatch)"), body


def test_locked_refuses_a_class_based_view_class(alias, name):
    """The class would become a function; as_view() would fail far from the cause."""
    with pytest.raises(ImproperlyConfigured, match="ReportView.*method_decorator"):

        @locked(name, backend=alias)
        class ReportView(View):
            pass


def test_async_view_and_custom_status(alias, name):
    @locked(name + ":{request.method}", backend=alias, status=423)
    async def view(request):
        return HttpResponse("ok")

    async def main():
        request = RequestFactory().get("/")
        assert (await view(request)).status_code == 200
        async with lock(name + ":GET", ttl=5, backend=alias):
            response = await view(request)
        assert response.status_code == 423 and int(response["Retry-After"]) <= 5

    asyncio.run(main())


@pytest.mark.no_db
def test_template_field_the_function_does_not_take():
    with pytest.raises(
        ImproperlyConfigured,
        match=r"refers to invoice_id, which .*charge\(order_id\) does not take",
    ):

        @locked("invoice:{invoice_id}")
        def charge(order_id):
            pass


@pytest.mark.no_db
def test_bad_decorator_arguments():
    with pytest.raises(
        ImproperlyConfigured,
        match="on_contention must be 'raise', 'skip' or a callable, got 'ignore'",
    ):
        locked("x", on_contention="ignore")
    # Review r126: a ValueError, where every other bad argument is ImproperlyConfigured.
    with pytest.raises(ImproperlyConfigured, match="@locked: .*got -1.0"):
        locked("x", timeout=-1)
    with pytest.raises(ImproperlyConfigured, match="@locked: .*nan"):
        locked("x", timeout=float("nan"))
    with pytest.raises(ImproperlyConfigured, match="positional field"):
        locked("x:{}")(lambda a: a)


@pytest.mark.no_db
@pytest.mark.parametrize(
    "options, message",
    [
        ({"ttl": -1}, r"@locked: ttl must be a positive, finite number of seconds, got -1"),
        ({"ttl": "30"}, r"@locked: ttl must be a number of seconds, not str: '30'"),
        ({"ttl": True}, r"@locked: ttl must be a number of seconds, not bool: True"),
        ({"status": 200}, r"status must be an HTTP error status from 400 to 599.*got 200"),
        ({"status": 4090}, r"status must be .*got 4090"),
        ({"status": "409"}, r"status must be .*got '409'"),
        ({"auto_renew": "yes"}, r"auto_renew must be True or False, got 'yes'"),
        ({"backend": None}, r"backend must be the alias of a lock backend.*got None"),
    ],
)
def test_arguments_that_would_fail_every_call_or_the_busy_answer_fail_at_decoration(
    options, message
):
    """Not on the first call, which may be a rare contended one in production."""
    with pytest.raises(ImproperlyConfigured, match=message):
        locked("x", **options)


@pytest.mark.no_db
@pytest.mark.parametrize(
    "template, message",
    [
        ("a{", r"template 'a\{' is not a valid str.format template"),
        ("a}b", r"template 'a\}b' is not a valid str.format template"),
        ("{x!z}", r"template '\{x!z\}' uses the conversion !z"),
    ],
)
def test_a_template_str_format_cannot_fill_fails_at_decoration_naming_it(template, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        locked(template)(lambda x: x)


@pytest.mark.no_db
@pytest.mark.parametrize(
    "template, options, message",
    [
        ("a\x00b", {}, "must not contain NUL"),
        ("a\x1fb", {}, "must not contain \\\\x1f"),
        ("x" * 201, {}, "201 characters long, the limit is 200"),
        ("x" * 199, {"limit": 5}, "199 characters long, the limit is 198 with limit=5"),
    ],
)
def test_a_literal_name_no_lock_may_have_fails_at_decoration(template, options, message):
    """Review r119: nothing of it comes from the call, so it is the code's fault, not
    the client's: not a 400 on every request to the view."""
    with pytest.raises(ImproperlyConfigured, match=message):
        locked(template, **options)(lambda request: None)


def test_template_field_missing_at_call_time_writes_nothing(alias, name):
    @locked(name + ":{region}", backend=alias)
    def sync(**options):
        return "ran"

    with pytest.raises(ValueError, match=r"cannot be filled .*'region'.*arguments were \[\]"):
        sync()
    assert lock(name + ":{region}", backend=alias).info() is None
    assert sync(region="eu") == "ran"


# -- generators ------------------------------------------------------------------------


def test_generator_holds_the_lock_until_exhausted(alias, name):
    @locked(name, ttl=30, backend=alias)
    def numbers(n):
        for i in range(n):
            yield i, lock(name, backend=alias).locked()

    gen = numbers(3)
    assert not lock(name, backend=alias).locked(), "nothing runs before the first step"
    assert list(gen) == [(0, True), (1, True), (2, True)]
    assert not lock(name, backend=alias).locked()


def test_generator_closed_early_releases(alias, name):
    @locked(name, ttl=30, backend=alias)
    def forever():
        while True:
            yield 1

    gen = forever()
    assert next(gen) == 1
    assert lock(name, backend=alias).locked()
    gen.close()
    assert not lock(name, backend=alias).locked()


def test_generator_send_and_return_pass_through(alias, name):
    @locked(name, ttl=30, backend=alias)
    def echo():
        received = yield "ready"
        return received * 2

    gen = echo()
    assert next(gen) == "ready"
    with pytest.raises(StopIteration) as stop:
        gen.send(21)
    assert stop.value.value == 42
    assert not lock(name, backend=alias).locked()


def test_contended_generator(alias, name):
    @locked(name, ttl=30, backend=alias)
    def raising():
        yield 1

    @locked(name, ttl=30, backend=alias, on_contention="skip")
    def skipping():
        yield 1

    with lock(name, ttl=30, backend=alias):
        with pytest.raises(LockNotAcquired):
            next(raising())
        assert list(skipping()) == []


def test_async_generator_holds_the_lock_until_exhausted(alias, name):
    @locked(name, ttl=30, backend=alias)
    async def numbers(n):
        for i in range(n):
            yield i, await lock(name, backend=alias).alocked()

    async def main():
        seen = [item async for item in numbers(3)]
        return seen, await lock(name, backend=alias).alocked()

    seen, after = asyncio.run(main())
    assert seen == [(0, True), (1, True), (2, True)] and after is False


def test_async_generator_closed_early_releases(alias, name):
    @locked(name, ttl=30, backend=alias)
    async def forever():
        while True:
            yield 1

    async def main():
        agen = forever()
        await agen.__anext__()
        during = await lock(name, backend=alias).alocked()
        await agen.aclose()
        return during, await lock(name, backend=alias).alocked()

    assert asyncio.run(main()) == (True, False)


# -- methods, descriptors, recursion ---------------------------------------------------------


def test_above_staticmethod_and_classmethod(alias, name):
    class Service:
        @locked(name + ":static:{x}", backend=alias)
        @staticmethod
        def static(x):
            return lock(f"{name}:static:{x}", backend=alias).locked()

        @locked(name + ":class:{cls.__name__}", backend=alias)
        @classmethod
        def klass(cls):
            return lock(f"{name}:class:Service", backend=alias).locked()

    assert Service.static(1) is True and Service().static(2) is True
    assert Service.klass() is True
    assert not lock(f"{name}:class:Service", backend=alias).locked()


def test_recursive_call_is_a_clear_error(alias, name):
    @locked(name, ttl=30, backend=alias, timeout=5)
    def walk(depth):
        return depth if depth == 0 else walk(depth - 1)

    with pytest.raises(LockError, match="recursive call"):
        walk(2)
    assert not lock(name, backend=alias).locked(), "the outer call released its lock"
    assert walk(0) == 0


def test_sequential_calls_in_one_transaction_share_the_held_lock(alias, name):
    """With release after COMMIT, a second call in the same transaction would wait for
    its own earlier call's lock: it runs under that lock instead."""
    from django.db import transaction

    @locked(name, ttl=30, backend=alias)
    def step(i):
        return i

    with transaction.atomic():
        assert [step(i) for i in range(3)] == [0, 1, 2]
        assert lock(name, backend=alias).locked()
    assert not lock(name, backend=alias).locked()


def test_lock_lost_is_sent_when_release_finds_it_gone(alias, name):
    from django_setnx import locks
    from django_setnx.signals import lock_lost

    lost = []
    lock_lost.connect(
        lambda lock, **kw: lost.append(lock.name), weak=False, dispatch_uid="test-dec-lost"
    )
    try:

        @locked(name, ttl=30, backend=alias)
        def guarded():
            locks[alias].delete(name)  # force-released while the call runs

        with pytest.raises(LockNotOwned):
            guarded()
        assert lost == [name]
    finally:
        lock_lost.disconnect(dispatch_uid="test-dec-lost")


def test_a_task_created_inside_a_locked_coroutine_may_wait_for_the_lock(alias, name):
    """Not a recursive call: the task is another runner, and waits for the release."""
    runs = []

    @locked(name, ttl=30, backend=alias, timeout=10)
    async def refresh(i, spawn):
        runs.append(i)
        if spawn:
            return asyncio.create_task(refresh(i + 1, False))
        return None

    async def main():
        follow_up = await refresh(0, True)
        await follow_up

    asyncio.run(main())
    assert runs == [0, 1]


def test_recursive_generators_are_a_clear_error(alias, name):
    @locked(name, ttl=30, backend=alias, timeout=5)
    def walk(depth):
        yield depth
        if depth:
            yield from walk(depth - 1)

    @locked(name + ":a", ttl=30, backend=alias, timeout=5)
    async def awalk(depth):
        yield depth
        if depth:
            async for item in awalk(depth - 1):
                yield item

    with pytest.raises(LockError, match="recursive call"):
        list(walk(2))

    async def consume():
        return [item async for item in awalk(2)]

    with pytest.raises(LockError, match="recursive call"):
        asyncio.run(consume())
    assert not lock(name, backend=alias).locked()


def test_generators_in_one_transaction_share_the_held_lock(alias, name):
    from django.db import transaction

    @locked(name, ttl=30, backend=alias)
    def rows(n):
        yield from range(n)

    with transaction.atomic():
        assert list(rows(2)) == [0, 1]
        assert list(rows(3)) == [0, 1, 2], "the second waited for the first's lock"
        assert lock(name, backend=alias).locked()
    assert not lock(name, backend=alias).locked()


def test_a_suspended_generator_is_contention_not_recursion(alias, name):
    """A generator suspended at a ``yield`` holds its lock, but the caller's next call
    of that lock is ordinary contention (skip here), not a recursive call."""

    @locked(name, ttl=30, backend=alias, on_contention="skip")
    def rows():
        yield 1
        yield 2

    @locked(name, ttl=30, backend=alias, on_contention="skip")
    def report():
        return "ran"

    first = rows()
    assert next(first) == 1
    assert report() is None, "skipped: the suspended generator holds the lock"
    assert list(rows()) == [], "a second generator yields nothing"
    assert list(zip(rows(), first)) == [], "zip of two: the first is still the holder"
    first.close()
    assert report() == "ran"

    @locked(name + ":a", ttl=30, backend=alias, on_contention="skip")
    async def arows():
        yield 1
        yield 2

    @locked(name + ":a", ttl=30, backend=alias, on_contention="skip")
    async def areport():
        return "ran"

    async def main():
        agen = arows()
        assert await agen.__anext__() == 1
        assert await areport() is None
        await agen.aclose()
        assert await areport() == "ran"

    asyncio.run(main())


def test_a_semaphore_may_be_taken_again_by_its_holder(alias, name):
    """Nested calls of a semaphore of N > 1 slots each take a slot; past N, the
    innermost meets contention (it is not refused as recursive)."""

    @locked(name, ttl=30, backend=alias, limit=2)
    def nest(depth):
        return 1 if depth == 0 else 1 + nest(depth - 1)

    assert nest(1) == 2
    with pytest.raises(LockNotAcquired):
        nest(2)
    assert nest(1) == 2, "every slot was released"


def test_async_view_retry_after_is_the_holders_ttl(alias, name):
    """The async wrapper looks the holder up with the async API: a database backend
    refuses a sync call in an event loop, which used to make ``Retry-After`` 1."""

    @locked(name, backend=alias)
    async def view(request):
        return HttpResponse("ok")

    async def main():
        async with lock(name, ttl=40, backend=alias):
            return await view(RequestFactory().get("/"))

    response = asyncio.run(main())
    assert response.status_code == 409
    assert 38 <= int(response["Retry-After"]) <= 40


def test_an_async_view_runs_sync_contention_callables_outside_the_event_loop(alias, name):
    """Review r151: a sync ``on_contention`` or ``retry_after`` of an async view ran
    in the event loop: one that used the ORM or the lock's sync API (a database
    backend refuses sync calls there) failed, and only under contention. They run
    in Django's sync thread, as a sync view's would; async ones in the loop."""
    import threading

    threads = {}

    def busy(lk, request):
        threads["on_contention"] = threading.current_thread()
        info = lk.info()  # the sync API
        return HttpResponse(f"busy {info.expires_in > 30}", status=423)

    def time_left(lk, request):
        threads["retry_after"] = threading.current_thread()
        return lk.info().expires_in + 100

    async def abusy(lk, request):
        threads["async on_contention"] = threading.current_thread()
        return HttpResponse("abusy", status=423)

    @locked(name, backend=alias, on_contention=busy)
    async def view(request):
        return HttpResponse("ok")

    @locked(name, backend=alias, retry_after=time_left)
    async def view_with_retry_after(request):
        return HttpResponse("ok")

    @locked(name, backend=alias, on_contention=abusy)
    async def view_with_async_callable(request):
        return HttpResponse("ok")

    async def main():
        async with lock(name, ttl=40, backend=alias):
            threads["loop"] = threading.current_thread()
            return [
                await v(RequestFactory().get("/"))
                for v in (view, view_with_retry_after, view_with_async_callable)
            ]

    busy_page, with_retry_after, async_page = asyncio.run(main())
    assert (busy_page.status_code, busy_page.content) == (423, b"busy True")
    assert with_retry_after.status_code == 409
    assert 138 <= int(with_retry_after["Retry-After"]) <= 140
    assert async_page.content == b"abusy"
    assert threads["on_contention"] is not threads["loop"]
    assert threads["retry_after"] is not threads["loop"]
    assert threads["async on_contention"] is threads["loop"]


def test_a_streaming_response_dropped_unsent_in_an_event_loop_releases(alias, name):
    """Under ASGI a streaming response replaced by a middleware is collected in the
    event loop's thread: the lock is released there the async way (a database
    backend refuses the sync call), not left until its ttl."""
    import gc

    from django.http import StreamingHttpResponse

    @locked(name, ttl=60, backend=alias)
    async def view(request):
        async def chunks():
            yield b"x"

        return StreamingHttpResponse(chunks())

    async def main():
        response = await view(RequestFactory().get("/"))
        assert await lock(name, backend=alias).alocked()
        del response
        gc.collect()
        for _ in range(200):
            if not await lock(name, backend=alias).alocked():
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main()), "released within 2 s, not at the ttl"

    async def dropped_last():
        response = await view(RequestFactory().get("/"))
        del response
        gc.collect()  # the loop's last step: asyncio.run ends right after

    asyncio.run(dropped_last())
    deadline = time.monotonic() + 2
    while lock(name, backend=alias).locked() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not lock(name, backend=alias).locked(), "released, though the loop ended"


def test_streaming_responses_collected_inside_the_backends_own_calls(alias, name):
    """A dropped streaming response in a reference cycle is freed by the cyclic
    garbage collector wherever it next runs: maybe inside this backend's own call on
    the same connection (psycopg's connection lock is not reentrant). The finalizer
    only queues the release, so nothing hangs, and every lock is freed."""
    import gc
    import threading

    from django.http import StreamingHttpResponse

    @locked(name + ":{i}", ttl=60, backend=alias)
    def view(request, i):
        return StreamingHttpResponse(iter([b"a"]))

    done = []

    def drop_many():
        for i in range(400):
            response = view(RequestFactory().get("/"), i)
            response.cycle = response  # freed by the cyclic collector, later
            del response
        done.append(True)

    worker = threading.Thread(target=drop_many, daemon=True)
    worker.start()
    worker.join(60)
    assert done, "hung: the finalizer released inside the backend's own call"
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        lock(f"{name}:{i}", backend=alias).locked() for i in (0, 199, 399)
    ):
        time.sleep(0.05)
    assert not any(lock(f"{name}:{i}", backend=alias).locked() for i in range(400))
