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

As on a native changelist:

- the action form posts to the list itself; "Go" with no lock ticked, or with no
  (or an unknown) action, comes back to the list with Django's own warning;
- the list's query string (filters, search, sort, page) travels as
  ``_changelist_filters`` through the confirmation pages (and their "No, take me
  back" link) to the redirect after the action (``get_preserved_filters``);
- the column headers sort (``o``, in Django's ChangeList syntax: ``o=6.-1`` is
  "acquired, then name descending"; columns are numbered as Django numbers them,
  the action checkbox being column 0, whether or not it is shown);
- "Show counts" (``ModelAdmin.show_facets`` and ``_facets``) puts the number of
  locks next to each filter choice. Django 4.2's admin has no facets: there the
  page offers its counts on request, as ``ShowFacets.ALLOW`` (5.0's default) does.

Times are shown in the current time zone with ``USE_TZ = True`` and in UTC
otherwise (the backends' clocks are epoch milliseconds), always with the zone's
name next to them.
"""

import datetime
import json
from urllib.parse import urlencode

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.admin.templatetags.admin_urls import add_preserved_filters
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpResponseBadRequest, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from .admin_views import (
    PER_PAGE,
    LockPage,
    ReleaseOutcome,
    format_duration,
    owner_fields,
    release_if_unchanged,
    state_counts,
)
from .backends import paging
from .backends.base import HELD, STALE, STATES
from .conf import MAX_NAME_LENGTH
from .display import isolated, marked_html, printable, record_display_name
from .exceptions import LockBackendError
from .globs import compile_glob, escape, search_to_glob
from .handler import locks
from .models import LockRecord
from .signals import lock_force_released
from .validation import slot_record, validate_record_name

try:  # Django 5.0+: "Show counts" next to the filter choices.
    from django.contrib.admin.options import IS_FACETS_VAR, ShowFacets
except ImportError:  # Django 4.2: no facets; the Locks page offers counts on request.
    IS_FACETS_VAR, ShowFacets = "_facets", None  # type: ignore[misc,assignment]

PAGE_VAR = "p"
SEARCH_VAR = "q"
BACKEND_VAR = "backend"
STATE_VAR = "state"
ORDER_VAR = "o"
SELECTED_VAR = "_selected_action"
LOCK_VAR = "lock"
ACTION_VAR = "action"
RELEASE_ACTION = "release_selected"
#: The list's columns, in order: (CSS name, sort field or None, header). In ``o``,
#: a column's number is its position + 1 (Django's, with the action checkbox first).
COLUMNS = (
    ("name", "name", gettext_lazy("Name")),
    ("backend", "backend", gettext_lazy("Backend")),
    ("state", "state", gettext_lazy("State")),
    ("owner", None, gettext_lazy("Owner")),
    ("fencing_token", "fencing_token", gettext_lazy("Fencing token")),
    ("acquired_at", "acquired_at", gettext_lazy("Acquired at")),
    ("expires_in", "expires_at", gettext_lazy("Expires")),
)
SORTABLE = {number: field for number, (_css, field, _text) in enumerate(COLUMNS, 1) if field}
#: Names listed in a LogEntry of "clear stale locks" (the count is always exact).
LOGGED_NAMES = 50


def shown(text):
    """User data as the admin writes it in plain text (a message, the log; see
    django_setnx.display)."""
    return printable(text, backslash=False)


def shown_html(text):
    """User data as the admin's pages show it: :func:`shown`, with its escapes
    marked (see django_setnx.display.marked_html)."""
    return marked_html(text)


def _selection_value(alias, name):
    return json.dumps([alias, name])


def parse_ordering(value):
    """``[(column number, descending)]`` of an ``o`` value such as ``"6.-1"``,
    read as Django's ChangeList reads it: parts that are not a sortable column
    are ignored, and so is a column's second mention."""
    ordering = []
    for part in value.split("."):
        _none, minus, number = part.rpartition("-")
        try:
            number = int(number)
        except ValueError:
            continue
        if number in SORTABLE and number not in dict(ordering):
            ordering.append((number, minus == "-"))
    return ordering


def format_ordering(ordering):
    """The ``o`` value of ``[(column number, descending)]``."""
    return ".".join(f"{'-' if descending else ''}{number}" for number, descending in ordering)


def sort_headers(ordering, query_string):
    """The column headers, as Django's ``result_headers`` gives them to
    ``change_list_results.html``: a click on a header sorts by it first (toggling
    its direction when it already leads), "toggle" reverses it in place, "remove"
    drops it."""
    position = {number: i for i, (number, _descending) in enumerate(ordering)}
    headers = []
    for number, (css, field, text) in enumerate(COLUMNS, 1):
        if field is None:
            headers.append({"text": text, "class_attrib": f"column-{css}", "sortable": False})
            continue
        classes = ["sortable", f"column-{css}"]
        descending = dict(ordering).get(number)
        if number in position:
            classes.append("sorted " + ("descending" if descending else "ascending"))
        others = [(n, d) for n, d in ordering if n != number]
        flipped = (number, not descending) if number in position else (number, False)
        toggled = [flipped if n == number else (n, d) for n, d in ordering]
        headers.append(
            {
                "text": text,
                "class_attrib": " ".join(classes),
                "sortable": True,
                "sorted": number in position,
                "ascending": descending is False,
                "sort_priority": position.get(number, -1) + 1,
                "url_primary": query_string(**{ORDER_VAR: format_ordering([flipped, *others])}),
                "url_remove": query_string(**{ORDER_VAR: format_ordering(others)}),
                "url_toggle": query_string(**{ORDER_VAR: format_ordering(toggled)}),
            }
        )
    return headers


def display_time(moment):
    """``{"text", "iso", "zone"}`` of an aware datetime: in the current time zone
    with USE_TZ (zone: its name), else in UTC (zone: "UTC"), which is also where a
    clamped, absurd time that the zone cannot represent stays."""
    zone, zone_name = datetime.timezone.utc, "UTC"
    if settings.USE_TZ:
        zone, zone_name = timezone.get_current_timezone(), timezone.get_current_timezone_name()
    try:
        local = moment.astimezone(zone)
    except OverflowError:
        local, zone_name = moment.astimezone(datetime.timezone.utc), "UTC"
    return {
        "text": local.replace(tzinfo=None).isoformat(sep=" ", timespec="seconds"),
        "iso": local.isoformat(timespec="seconds"),
        "zone": zone_name,
    }


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
        return reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_{what}"
        )

    # -- shared helpers -----------------------------------------------------------

    def _aliases(self):
        return list(locks)

    def _backends(self, aliases):
        """``([(alias, backend)], errors)`` for ``aliases``; aliases that cannot be
        loaded go to ``errors``."""
        backends, errors = [], {}
        for alias in aliases:
            try:
                backends.append((alias, locks[alias]))
            except Exception as exc:  # noqa: BLE001 - ImproperlyConfigured, ImportError
                errors[alias] = str(exc)
        return backends, errors

    def _confirmation(self, request, template, **context):
        """An "Are you sure?" page (``locks/<template>``), whose cancel link goes back
        to the list as it was."""
        context = self._context(
            request,
            title=_("Are you sure?"),
            subtitle=None,
            cancel_url=self._preserved(request, self._url("changelist")),
            **context,
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, f"admin/django_setnx/locks/{template}", context)

    def _preserved(self, request, url):
        """``url`` carrying the list's query string: merged into it when ``url`` is
        the list, as ``_changelist_filters`` otherwise (Django's
        ``add_preserved_filters``)."""
        return add_preserved_filters(
            {"preserved_filters": self.get_preserved_filters(request), "opts": self.opts}, url
        )

    def _back_to_list(self, request):
        """A redirect to the list, with the query string it was left with."""
        return HttpResponseRedirect(self._preserved(request, self._url("changelist")))

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
            expires_text = _("expired %(duration)s ago") % {
                "duration": format_duration(-expires_in)
            }
        return {
            "info": info,
            # Escaped where a character could reorder or forge the page (see display).
            "name": shown_html(info.display_name),
            "backend": info.backend,
            "state": info.state,
            "host": shown_html(host),
            "pid": pid,
            "thread": shown_html(thread),
            "guards": shown_html(guards),
            "fencing_token": info.fencing_token,
            "acquired_at": display_time(info.acquired_at),
            "expires_at": display_time(info.expires_at),
            "expires_text": expires_text,
            "selection_value": _selection_value(info.backend, info.name),
        }

    def _rows(self, infos):
        """The table rows of ``infos``, with a heading row above each run of one
        semaphore's slots: its name and how many of its slots are held."""
        infos = list(infos)
        held = self._held_slots(infos)
        rows, previous = [], None
        for info in infos:
            semaphore = info.semaphore
            key = None if semaphore is None else (info.backend, semaphore[0])
            if key is not None and key != previous:
                name, _slot, limit = semaphore
                rows.append(
                    {
                        "semaphore": shown_html(name),
                        "backend": info.backend,
                        "held": held.get((info.backend, name, limit)),
                        "limit": limit,
                    }
                )
            previous = key
            rows.append(self._row(info))
        return rows

    def _held_slots(self, infos):
        """``{(backend, semaphore name, limit): slots held now}`` for the semaphores
        of ``infos``, counted on the backends (the page may show only some of a
        semaphore's slots): one get_many per backend for every slot of every such
        semaphore. A backend that fails leaves its semaphores out (shown as "?")."""
        wanted = {}  # backend -> {(name, limit): [slot record names]}
        for info in infos:
            semaphore = info.semaphore
            if semaphore is None or semaphore[2] is None:
                continue
            name, _slot, limit = semaphore
            slots = wanted.setdefault(info.backend, {})
            if (name, limit) not in slots:
                slots[name, limit] = [slot_record(name, slot) for slot in range(1, limit + 1)]
        held = {}
        for alias, semaphores in wanted.items():
            try:
                found = locks[alias].get_many(
                    [record for records in semaphores.values() for record in records]
                )
            except LockBackendError:
                continue
            for (name, limit), records in semaphores.items():
                held[alias, name, limit] = sum(
                    1
                    for record in records
                    if (found[record] is not None and found[record].is_held)
                )
        return held

    def _facets(self, request):
        """``(show counts now, can the user toggle them)`` by ``show_facets``."""
        if ShowFacets is None:  # Django 4.2: as ShowFacets.ALLOW
            return IS_FACETS_VAR in request.GET, True
        mode = getattr(self, "show_facets", None)
        if mode is None:
            return False, False
        shown = mode is ShowFacets.ALWAYS or (
            mode is ShowFacets.ALLOW and IS_FACETS_VAR in request.GET
        )
        return shown, mode is ShowFacets.ALLOW

    # -- the list -----------------------------------------------------------------

    def locks_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            # The changelist form posts its action and selection here (as Django's does).
            return self._run_action(request)

        aliases = self._aliases()
        params = {}
        notes = []
        backend_filter = request.GET.get(BACKEND_VAR) or None
        if backend_filter is not None:
            if backend_filter in aliases:
                params[BACKEND_VAR] = backend_filter
            else:
                notes.append(
                    _("There is no lock backend %(alias)r; showing every backend.")
                    % {"alias": backend_filter}
                )
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
        columns = parse_ordering(request.GET.get(ORDER_VAR, ""))
        if columns:
            params[ORDER_VAR] = format_ordering(columns)
        show_counts, counts_optional = self._facets(request)
        if counts_optional and show_counts:
            params[IS_FACETS_VAR] = "True"
        try:
            number = max(1, int(request.GET.get(PAGE_VAR, 1)))
        except ValueError:
            number = 1

        glob = search_to_glob(query)
        matches_nothing = False
        if glob is not None:
            try:
                compile_glob(glob)
            except ValueError as exc:
                notes.append(
                    _("%(error)s Searching for the text as typed instead.") % {"error": exc}
                )
                glob = f"*{escape(query)}*"
                # Text longer than any name is in no name: say so rather than search
                # for it (its glob may be longer than compile_glob accepts).
                matches_nothing = len(query) > MAX_NAME_LENGTH
                if matches_nothing:
                    notes.append(
                        _(
                            "No lock name is longer than %(limit)s characters: "
                            "nothing contains these %(length)s."
                        )
                        % {"limit": MAX_NAME_LENGTH, "length": len(query)}
                    )
        backends, load_errors = self._backends(aliases)
        selected = [
            (alias, backend)
            for alias, backend in backends
            if backend_filter in (None, alias) and not matches_nothing
        ]
        page = LockPage(
            selected,
            state=state,
            glob=glob,
            number=number,
            ordering=[(SORTABLE[n], descending) for n, descending in columns],
        )
        errors = {
            **{
                alias: error
                for alias, error in load_errors.items()
                if backend_filter in (None, alias)
            },
            **page.errors,
        }
        if page.partially_sorted:
            notes.append(
                ngettext(
                    "Only partly sorted: the backend %(aliases)s has more than %(limit)s "
                    "matching locks. The first %(limit)s it returned are sorted with the "
                    "others; the rest follow, unsorted, after them. Filter or search to "
                    "narrow the list for a complete order.",
                    "Only partly sorted: the backends %(aliases)s have more than %(limit)s "
                    "matching locks each. The first %(limit)s each returned are sorted with "
                    "the others; the rest follow, unsorted, after them. Filter or search to "
                    "narrow the list for a complete order.",
                    len(page.partially_sorted),
                )
                % {"aliases": ", ".join(page.partially_sorted), "limit": paging.SORT_LIMIT}
            )

        def query_string(**changes):
            new = {**params, **changes}
            return "?" + urlencode({k: v for k, v in new.items() if v not in (None, "")})

        counts = {}
        if show_counts:
            # Each filter's counts apply the other filter and the search, as
            # Django's facets do; a backend that failed is not asked again.
            counts = state_counts(
                [
                    (alias, backend)
                    for alias, backend in backends
                    if alias not in errors and not matches_nothing
                ],
                glob,
            )

        def with_count(display, count):
            return display if count is None else f"{display} ({count})"

        def backend_count(alias):
            per_state = counts.get(alias, {})
            wanted = [per_state.get(s) for s in ([state] if state else STATES)]
            return None if None in wanted else sum(wanted)

        def state_count(value):
            wanted = [
                counts.get(alias, {}).get(value)
                for alias in ([backend_filter] if backend_filter else aliases)
            ]
            return None if None in wanted else sum(wanted)

        def choices(var, selected, options, count):
            """A filter's links: "All", then each ``(value, label)`` of ``options``,
            with ``count(value)`` when counts are shown."""
            return [
                {
                    "display": _("All"),
                    "selected": selected is None,
                    "query_string": query_string(**{var: None, PAGE_VAR: None}),
                }
            ] + [
                {
                    "display": with_count(label, count(value) if show_counts else None),
                    "selected": selected == value,
                    "query_string": query_string(**{var: value, PAGE_VAR: None}),
                }
                for value, label in options
            ]

        backend_choices = choices(
            BACKEND_VAR, backend_filter, [(alias, alias) for alias in aliases], backend_count
        )
        state_choices = choices(
            STATE_VAR, state, ((HELD, _("Held")), (STALE, _("Stale"))), state_count
        )

        page_links = []
        if page.num_pages is not None and page.num_pages > 1:
            paginator = Paginator(range(page.total), PER_PAGE)
            for i in paginator.get_elided_page_range(min(number, page.num_pages)):
                if i == Paginator.ELLIPSIS:
                    page_links.append({"ellipsis": True, "text": i})
                else:
                    page_links.append(
                        {
                            "number": i,
                            "current": i == number,
                            "query_string": query_string(**{PAGE_VAR: i}),
                        }
                    )

        facet_links = {}
        if counts_optional:
            facet_links = {
                "add_counts_query": query_string(**{IS_FACETS_VAR: "True"}),
                "remove_counts_query": query_string(**{IS_FACETS_VAR: None}),
            }
        headers = sort_headers(columns, query_string)
        context = self._context(
            request,
            title=_("Locks"),
            subtitle=None,
            headers=headers,
            num_sorted_fields=len(columns),
            rows=self._rows(page.rows),
            lock_count=len(page.rows),
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
            clear_filters_query=query_string(
                **{BACKEND_VAR: None, STATE_VAR: None, PAGE_VAR: None}
            ),
            counts_optional=counts_optional,
            show_counts=show_counts,
            **facet_links,
            filter_specs=[
                {"title": _("backend"), "choices": backend_choices},
                {"title": _("state"), "choices": state_choices},
            ],
            backend_filter=backend_filter,
            clear_url=self._preserved(
                request,
                self._url("clear")
                + ("?" + urlencode({BACKEND_VAR: backend_filter}) if backend_filter else ""),
            ),
            selected_var=SELECTED_VAR,
            action_var=ACTION_VAR,
            release_action=RELEASE_ACTION,
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
            validate_record_name(name)
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
        """GET (``lock`` values): the confirmation page. POST with ``post=yes``:
        release the confirmed locks. Any other POST: the list's action form."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if request.POST.get("post") == "yes":
                return self._do_release(request)
            return self._run_action(request)
        return self._confirm_release(request, request.GET.getlist(LOCK_VAR))

    def _run_action(self, request):
        """The list's action form, answered as Django's changelist_view and
        response_action answer theirs: with nothing ticked, or no known action
        chosen, a warning and back to the list (as it was); else the confirmation."""
        if not self.has_release_permission(request):
            raise PermissionDenied
        values = request.POST.getlist(SELECTED_VAR)
        if not values:
            return self._nothing_selected(request)
        if request.POST.get(ACTION_VAR) != RELEASE_ACTION:
            messages.warning(request, _("No action selected."))
            return self._back_to_list(request)
        return self._confirm_release(request, values)

    def _nothing_selected(self, request):
        messages.warning(
            request,
            _(
                "Items must be selected in order to perform actions on them. No items "
                "have been changed."
            ),
        )
        return self._back_to_list(request)

    def _confirm_release(self, request, values):
        try:
            selection = self._parse_all(values, with_token=False)
        except BadSelection as exc:
            return HttpResponseBadRequest(
                f"Invalid lock selection: {exc}", content_type="text/plain"
            )
        if not selection:
            return self._nothing_selected(request)

        found, gone, errors = [], [], []
        for alias, name in selection:
            try:
                info = locks[alias].get(name)
            except LockBackendError as exc:
                errors.append(str(exc))
                continue
            if info is None:
                gone.append({"alias": alias, "name": shown_html(name)})
            else:
                row = self._row(info)
                row["confirm_value"] = json.dumps([alias, name, info.fencing_token])
                found.append(row)
        return self._confirmation(
            request,
            "release_confirmation.html",
            found=found,
            gone=gone,
            errors=errors,
            lock_var=LOCK_VAR,
            release_url=self._preserved(request, self._url("release")),
        )

    def _do_release(self, request):
        try:
            selection = self._parse_all(request.POST.getlist(LOCK_VAR), with_token=True)
        except BadSelection as exc:
            return HttpResponseBadRequest(
                f"Invalid lock selection: {exc}", content_type="text/plain"
            )
        backends, load_errors = self._backends(sorted({alias for alias, _n, _t in selection}))
        backends = dict(backends)
        released, changed, gone = [], [], []
        for alias, name, token in selection:
            if alias not in backends:
                messages.error(
                    request,
                    _("Lock backend %(alias)r cannot be loaded: %(error)s")
                    % {"alias": alias, "error": load_errors.get(alias, "")},
                )
                continue
            try:
                outcome = release_if_unchanged(backends[alias], name, token)
            except LockBackendError as exc:
                messages.error(request, str(exc))
                continue
            if outcome.status == ReleaseOutcome.RELEASED:
                self.log_force_release(request, alias, outcome.info)
                lock_force_released.send(
                    sender=type(locks[alias]),
                    backend=alias,
                    name=name,
                    info=outcome.info,
                    user=request.user,
                    reason=f"force-released in the admin by {request.user.get_username()}",
                )
                released.append(f"{alias}: {isolated(record_display_name(name))}")
            elif outcome.status == ReleaseOutcome.CHANGED:
                changed.append(
                    _("%(alias)s: %(name)s (fencing token now %(token)s)")
                    % {
                        "alias": alias,
                        "name": isolated(record_display_name(name)),
                        "token": outcome.current.fencing_token,
                    }
                )
            else:
                gone.append(f"{alias}: {isolated(record_display_name(name))}")
        if released:
            messages.success(
                request,
                ngettext(
                    "Force-released %(count)d lock: %(names)s.",
                    "Force-released %(count)d locks: %(names)s.",
                    len(released),
                )
                % {"count": len(released), "names": ", ".join(released)},
            )
        if changed:
            messages.warning(
                request,
                ngettext(
                    "Not released, it changed hands since you confirmed: %(names)s.",
                    "Not released, they changed hands since you confirmed: %(names)s.",
                    len(changed),
                )
                % {"names": ", ".join(changed)},
            )
        if gone:
            messages.info(
                request,
                ngettext("Already gone: %(names)s.", "Already gone: %(names)s.", len(gone))
                % {"names": ", ".join(gone)},
            )
        return self._back_to_list(request)

    def log_force_release(self, request, alias, info):
        """Write the admin history entry of one forced release."""
        return LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(LockRecord).pk,
            object_id=f"{alias}:{info.name}",
            object_repr=f"{alias}: {shown(info.display_name)}"[:200],
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

        loaded, load_errors = self._backends(selected)
        backends = []
        for each, backend in loaded:
            try:
                count = backend.page(state=STALE, limit=0).total
                backends.append({"alias": each, "count": count})
            except LockBackendError as exc:
                backends.append({"alias": each, "error": str(exc)})
        for bad, error in load_errors.items():
            backends.append({"alias": bad, "error": error})
        return self._confirmation(
            request,
            "clear_confirmation.html",
            backends=backends,
            backend_filter=alias,
            clear_url=self._preserved(request, self._url("clear")),
        )

    def _do_clear(self, request, selected):
        content_type = ContentType.objects.get_for_model(LockRecord)
        for alias in selected:
            try:
                result = locks[alias].clear()
            except LockBackendError as exc:
                messages.error(
                    request,
                    _("Could not clear stale locks of %(alias)r: %(error)s")
                    % {"alias": alias, "error": exc},
                )
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
                object_repr=f"{alias}: {_stale_locks(result.count)}"[:200],
                action_flag=DELETION,
                change_message=(
                    f"Cleared {_stale_locks(result.count)} on backend {alias!r}: "
                    + ", ".join(repr(n) for n in shown)
                    + (f" and {more} more" if more else "")
                    + "."
                ),
            )
            messages.success(
                request,
                ngettext(
                    "Cleared %(count)d stale lock on %(alias)r.",
                    "Cleared %(count)d stale locks on %(alias)r.",
                    result.count,
                )
                % {"count": result.count, "alias": alias},
            )
        if self.get_preserved_filters(request) or len(selected) != 1:
            return self._back_to_list(request)
        # Reached without the list's query string: show the backend just cleared.
        return HttpResponseRedirect(
            self._url("changelist") + "?" + urlencode({BACKEND_VAR: selected[0]})
        )


def _stale_locks(count):
    """``"1 stale lock"``, ``"2 stale locks"``: the history's text, in English like
    Django's own change messages' keys (it is stored, not shown translated)."""
    return f"{count} stale lock{'' if count == 1 else 's'}"


admin.site.register(LockRecord, LockRecordAdmin)
