"""The "Locks" page of the Django admin: held and stale locks of every backend.

``LockRecord`` is registered so the admin index shows a "Locks" entry under the
app, but its changelist is replaced (as django-constance does for its settings) by
our own view, which lists the locks of *every* configured backend, Redis included,
through :mod:`django_setnx.admin_views`.

Permissions: ``django_setnx.view_lockrecord`` shows the page;
``django_setnx.release_lock`` (with the view permission) is needed to force-release
selected locks and to clear stale locks. Both actions go through a confirmation page
and a CSRF-protected POST; each forced release is written to the admin history
(``LogEntry``) and sends ``lock_force_released``.
"""

import json
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from .admin_views import (
    PER_PAGE,
    LockPage,
    ReleaseOutcome,
    format_duration,
    owner_fields,
    release_if_unchanged,
    search_to_glob,
    source_for,
)
from .backends.base import HELD, STALE, STATES
from .exceptions import LockBackendError
from .handler import locks
from .models import LockRecord
from .signals import lock_force_released
from .validation import validate_name

PAGE_VAR = "p"
SEARCH_VAR = "q"
BACKEND_VAR = "backend"
STATE_VAR = "state"
SELECTED_VAR = "_selected_action"
LOCK_VAR = "lock"
#: Names listed in a LogEntry of "clear stale locks" (the count is always exact).
LOGGED_NAMES = 50


def _selection_value(alias, name):
    return json.dumps([alias, name])


class BadSelection(ValueError):
    pass


class LockRecordAdmin(admin.ModelAdmin):
    """The Locks page; add/change/delete of single rows do not exist."""

    release_permission = "release_lock"

    # -- permissions --------------------------------------------------------------

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def has_view_permission(self, request, obj=None):
        opts = self.opts
        return request.user.has_perm(f"{opts.app_label}.view_{opts.model_name}")

    def has_release_permission(self, request):
        return self.has_view_permission(request) and request.user.has_perm(
            f"{self.opts.app_label}.{self.release_permission}"
        )

    # -- URLs ---------------------------------------------------------------------

    def get_urls(self):
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.locks_view), name=f"{prefix}_changelist"),
            path("release/", wrap(self.release_view), name=f"{prefix}_release"),
            path("clear-stale/", wrap(self.clear_view), name=f"{prefix}_clear"),
        ]

    def _url(self, what):
        return reverse(f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{what}")

    # -- shared helpers -----------------------------------------------------------

    def _aliases(self):
        return list(locks)

    def _sources(self, aliases):
        """``[source]`` for ``aliases``; aliases that cannot be loaded go to ``errors``."""
        sources, errors = [], {}
        for alias in aliases:
            try:
                sources.append(source_for(alias, locks[alias]))
            except Exception as exc:  # noqa: BLE001 - ImproperlyConfigured, ImportError
                errors[alias] = str(exc)
        return sources, errors

    def _context(self, request, **extra):
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "has_release_permission": self.has_release_permission(request),
            "changelist_url": self._url("changelist"),
            **extra,
        }

    def _row(self, info):
        host, pid, thread, guards = owner_fields(info)
        expires_in = info.expires_in
        if info.is_held:
            expires_text = _("in %(duration)s") % {"duration": format_duration(expires_in)}
        else:
            expires_text = _("expired %(duration)s ago") % {"duration": format_duration(-expires_in)}
        return {
            "info": info,
            "name": info.name,
            "backend": info.backend,
            "state": info.state,
            "host": host,
            "pid": pid,
            "thread": thread,
            "guards": guards,
            "fencing_token": info.fencing_token,
            "acquired_at": info.acquired_at,
            "expires_at": info.expires_at,
            "expires_text": expires_text,
            "selection_value": _selection_value(info.backend, info.name),
        }

    # -- the list -----------------------------------------------------------------

    def locks_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            # The changelist form posts its selection here (as Django's does).
            return self.release_view(request)

        aliases = self._aliases()
        params = {}
        notes = []
        backend_filter = request.GET.get(BACKEND_VAR) or None
        if backend_filter is not None:
            if backend_filter in aliases:
                params[BACKEND_VAR] = backend_filter
            else:
                notes.append(_("There is no lock backend %(alias)r; showing every backend.")
                             % {"alias": backend_filter})
                backend_filter = None
        state = request.GET.get(STATE_VAR) or None
        if state is not None:
            if state in STATES:
                params[STATE_VAR] = state
            else:
                notes.append(_("Unknown state %(state)r; showing every state.") % {"state": state})
                state = None
        query = request.GET.get(SEARCH_VAR, "")
        if query:
            params[SEARCH_VAR] = query
        try:
            number = max(1, int(request.GET.get(PAGE_VAR, 1)))
        except ValueError:
            number = 1

        selected = [backend_filter] if backend_filter else aliases
        sources, load_errors = self._sources(selected)
        page = LockPage(sources, state=state, glob=search_to_glob(query), number=number)
        errors = {**load_errors, **page.errors}

        def query_string(**changes):
            new = {**params, **changes}
            return "?" + urlencode({k: v for k, v in new.items() if v not in (None, "")})

        backend_choices = [
            {"display": _("All"), "selected": backend_filter is None,
             "query_string": query_string(**{BACKEND_VAR: None, PAGE_VAR: None})},
        ] + [
            {"display": alias, "selected": backend_filter == alias,
             "query_string": query_string(**{BACKEND_VAR: alias, PAGE_VAR: None})}
            for alias in aliases
        ]
        state_choices = [
            {"display": label, "selected": state == value,
             "query_string": query_string(**{STATE_VAR: value, PAGE_VAR: None})}
            for value, label in ((None, _("All")), (HELD, _("Held")), (STALE, _("Stale")))
        ]

        page_links = []
        if page.num_pages is not None and page.num_pages > 1:
            paginator = Paginator(range(page.total), PER_PAGE)
            for i in paginator.get_elided_page_range(min(number, page.num_pages)):
                if i == Paginator.ELLIPSIS:
                    page_links.append({"ellipsis": True, "text": i})
                else:
                    page_links.append({"number": i, "current": i == number,
                                       "query_string": query_string(**{PAGE_VAR: i})})

        context = self._context(
            request,
            title=_("Locks"),
            subtitle=None,
            rows=[self._row(info) for info in page.rows],
            errors=sorted(errors.items()),
            notes=notes,
            page=page,
            page_links=page_links,
            previous_query=query_string(**{PAGE_VAR: number - 1 if number > 2 else None}),
            next_query=query_string(**{PAGE_VAR: number + 1}),
            search_var=SEARCH_VAR,
            query=query,
            search_hidden=[(k, v) for k, v in params.items() if k != SEARCH_VAR],
            has_filters=True,
            has_active_filters=bool(backend_filter or state),
            clear_filters_query=query_string(**{BACKEND_VAR: None, STATE_VAR: None, PAGE_VAR: None}),
            filter_specs=[
                {"title": _("backend"), "choices": backend_choices},
                {"title": _("state"), "choices": state_choices},
            ],
            backend_filter=backend_filter,
            clear_url=self._url("clear") + (
                "?" + urlencode({BACKEND_VAR: backend_filter}) if backend_filter else ""),
            release_url=self._url("release"),
            selected_var=SELECTED_VAR,
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_setnx/locks/change_list.html", context)

    # -- force-release ------------------------------------------------------------

    def _parse(self, value, with_token):
        """``(alias, name[, fencing_token])`` from a posted JSON value, validated."""
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            raise BadSelection("not JSON") from exc
        size = 3 if with_token else 2
        if not isinstance(parsed, list) or len(parsed) != size:
            raise BadSelection(f"expected a list of {size} values")
        alias, name = parsed[0], parsed[1]
        if not isinstance(alias, str) or alias not in self._aliases():
            raise BadSelection(f"unknown lock backend {alias!r}")
        try:
            validate_name(name)
        except (TypeError, ValueError) as exc:
            raise BadSelection(str(exc)) from exc
        if not with_token:
            return alias, name
        token = parsed[2]
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise BadSelection("the fencing token must be a non-negative integer")
        return alias, name, token

    def _parse_all(self, values, with_token):
        seen = {}
        for value in values:
            parsed = self._parse(value, with_token)
            seen.setdefault(parsed[:2], parsed)
        return list(seen.values())

    def release_view(self, request):
        """GET or POST (the list's selection): the confirmation page.
        POST with ``post=yes``: release the confirmed locks."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        if request.method == "POST" and request.POST.get("post") == "yes":
            return self._do_release(request)
        data = request.POST if request.method == "POST" else request.GET
        values = data.getlist(SELECTED_VAR) or data.getlist(LOCK_VAR)
        try:
            selection = self._parse_all(values, with_token=False)
        except BadSelection as exc:
            return HttpResponseBadRequest(f"Invalid lock selection: {exc}", content_type="text/plain")
        if request.method == "POST" and data.get("action", "release_selected") != "release_selected":
            return HttpResponseBadRequest("Unknown action.", content_type="text/plain")
        if not selection:
            messages.warning(request, _(
                "Items must be selected in order to perform actions on them. No locks "
                "have been released."))
            return HttpResponseRedirect(self._url("changelist"))

        found, gone, errors = [], [], []
        for alias, name in selection:
            try:
                info = locks[alias].get(name)
            except LockBackendError as exc:
                errors.append(str(exc))
                continue
            if info is None:
                gone.append({"alias": alias, "name": name})
            else:
                row = self._row(info)
                row["confirm_value"] = json.dumps([alias, name, info.fencing_token])
                found.append(row)
        context = self._context(
            request,
            title=_("Are you sure?"),
            subtitle=None,
            found=found,
            gone=gone,
            errors=errors,
            lock_var=LOCK_VAR,
            release_url=self._url("release"),
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_setnx/locks/release_confirmation.html", context)

    def _do_release(self, request):
        try:
            selection = self._parse_all(request.POST.getlist(LOCK_VAR), with_token=True)
        except BadSelection as exc:
            return HttpResponseBadRequest(f"Invalid lock selection: {exc}", content_type="text/plain")
        sources, load_errors = self._sources(sorted({alias for alias, _n, _t in selection}))
        sources = {src.alias: src for src in sources}
        released, changed, gone = [], [], []
        for alias, name, token in selection:
            if alias not in sources:
                messages.error(request, _("Lock backend %(alias)r cannot be loaded: %(error)s")
                               % {"alias": alias, "error": load_errors.get(alias, "")})
                continue
            try:
                outcome = release_if_unchanged(sources[alias], name, token)
            except LockBackendError as exc:
                messages.error(request, str(exc))
                continue
            if outcome.status in (ReleaseOutcome.RELEASED, ReleaseOutcome.RACED):
                self.log_force_release(request, alias, outcome.info)
                lock_force_released.send(
                    sender=type(locks[alias]), backend=alias, name=name, info=outcome.info,
                    user=request.user,
                )
                released.append(f"{alias}: {name}")
                if outcome.status == ReleaseOutcome.RACED:
                    messages.warning(request, _(
                        "Lock %(name)r on %(alias)r was re-acquired (fencing token "
                        "%(token)s) just as it was released; the new holder's lock was "
                        "removed.") % {"name": name, "alias": alias,
                                       "token": outcome.info.fencing_token})
            elif outcome.status == ReleaseOutcome.CHANGED:
                changed.append(
                    _("%(alias)s: %(name)s (fencing token now %(token)s)")
                    % {"alias": alias, "name": name, "token": outcome.current.fencing_token})
            else:
                gone.append(f"{alias}: {name}")
        if released:
            messages.success(request, ngettext(
                "Force-released %(count)d lock: %(names)s.",
                "Force-released %(count)d locks: %(names)s.",
                len(released)) % {"count": len(released), "names": ", ".join(released)})
        if changed:
            messages.warning(request, ngettext(
                "Not released, it changed hands since you confirmed: %(names)s.",
                "Not released, they changed hands since you confirmed: %(names)s.",
                len(changed)) % {"names": ", ".join(changed)})
        if gone:
            messages.info(request, ngettext(
                "Already gone: %(names)s.", "Already gone: %(names)s.", len(gone))
                % {"names": ", ".join(gone)})
        return HttpResponseRedirect(self._url("changelist"))

    def log_force_release(self, request, alias, info):
        """Write the admin history entry of one forced release."""
        return LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(LockRecord).pk,
            object_id=f"{alias}:{info.name}",
            object_repr=f"{alias}: {info.name}"[:200],
            action_flag=DELETION,
            change_message=(
                f"Force-released lock {info.name!r} on backend {alias!r} "
                f"(fencing token {info.fencing_token}, {info.state})."
            ),
        )

    # -- clear stale --------------------------------------------------------------

    def clear_view(self, request):
        """GET: the confirmation page. POST with ``post=yes``: clear stale locks of
        one backend (``backend``) or of all."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        data = request.POST if request.method == "POST" else request.GET
        alias = data.get(BACKEND_VAR) or None
        aliases = self._aliases()
        if alias is not None and alias not in aliases:
            return HttpResponseBadRequest("Unknown lock backend.", content_type="text/plain")
        selected = [alias] if alias else aliases
        if request.method == "POST" and data.get("post") == "yes":
            return self._do_clear(request, selected)

        sources, load_errors = self._sources(selected)
        backends = []
        for src in sources:
            try:
                count = src.count(STALE, None)
                backends.append({"alias": src.alias, "count": count})
            except LockBackendError as exc:
                backends.append({"alias": src.alias, "error": str(exc)})
        for bad, error in load_errors.items():
            backends.append({"alias": bad, "error": error})
        context = self._context(
            request,
            title=_("Are you sure?"),
            subtitle=None,
            backends=backends,
            backend_filter=alias,
            clear_url=self._url("clear"),
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_setnx/locks/clear_confirmation.html", context)

    def _do_clear(self, request, selected):
        content_type = ContentType.objects.get_for_model(LockRecord)
        for alias in selected:
            try:
                result = locks[alias].clear()
            except LockBackendError as exc:
                messages.error(request, _("Could not clear stale locks of %(alias)r: %(error)s")
                               % {"alias": alias, "error": exc})
                continue
            if not result.count:
                messages.info(request, _("No stale locks on %(alias)r.") % {"alias": alias})
                continue
            shown = result.names[:LOGGED_NAMES]
            more = result.count - len(shown)
            LogEntry.objects.create(
                user_id=request.user.pk,
                content_type_id=content_type.pk,
                object_id=f"{alias}:*",
                object_repr=f"{alias}: {result.count} stale locks"[:200],
                action_flag=DELETION,
                change_message=(
                    f"Cleared {result.count} stale locks on backend {alias!r}: "
                    + ", ".join(repr(n) for n in shown)
                    + (f" and {more} more" if more else "") + "."
                ),
            )
            messages.success(request, ngettext(
                "Cleared %(count)d stale lock on %(alias)r.",
                "Cleared %(count)d stale locks on %(alias)r.",
                result.count) % {"count": result.count, "alias": alias})
        url = self._url("changelist")
        if len(selected) == 1:
            url += "?" + urlencode({BACKEND_VAR: selected[0]})
        return HttpResponseRedirect(url)


admin.site.register(LockRecord, LockRecordAdmin)
