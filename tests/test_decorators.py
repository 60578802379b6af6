"""``@locked`` on functions, methods, async functions and views, on every backend."""

import asyncio

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory

from django_setnx import lock, locked
from django_setnx.exceptions import LockNotAcquired


def test_template_is_filled_from_arguments(alias, name):
    seen = {}

    @locked(name + ":invoice:{invoice_id}:{currency}", ttl=30, backend=alias)
    def charge(invoice_id, amount, currency="EUR"):
        info = lock(f"{name}:invoice:{invoice_id}:{currency}", backend=alias).info()
        seen["info"] = info
        return amount * 2

    assert charge(7, 21) == 42
    assert seen["info"].is_held
    assert seen["info"].owner["guards"].endswith("test_template_is_filled_from_arguments.<locals>.charge")
    assert lock(f"{name}:invoice:7:EUR", backend=alias).info() is None


def test_contention_policies(alias, name):
    calls = []

    def job(n):
        calls.append(n)
        return n

    raising = locked(name + ":{n}", backend=alias)(job)
    skipping = locked(name + ":{n}", backend=alias, on_contention="skip")(job)
    answering = locked(name + ":{n}", backend=alias,
                       on_contention=lambda lk, n: f"busy {lk.name}")(job)
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
    with pytest.raises(ImproperlyConfigured, match=r"refers to invoice_id, which .*charge\(order_id\) does not take"):
        @locked("invoice:{invoice_id}")
        def charge(order_id):
            pass


@pytest.mark.no_db
def test_bad_decorator_arguments():
    with pytest.raises(ImproperlyConfigured, match="on_contention must be 'raise', 'skip' or a callable, got 'ignore'"):
        locked("x", on_contention="ignore")
    with pytest.raises(ValueError, match="got -1.0"):
        locked("x", timeout=-1)
    with pytest.raises(ImproperlyConfigured, match="positional field"):
        locked("x:{}")(lambda a: a)


def test_template_field_missing_at_call_time_writes_nothing(alias, name):
    @locked(name + ":{region}", backend=alias)
    def sync(**options):
        return "ran"

    with pytest.raises(ValueError, match=r"cannot be filled .*'region'.*arguments were \[\]"):
        sync()
    assert lock(name + ":{region}", backend=alias).info() is None
    assert sync(region="eu") == "ran"
